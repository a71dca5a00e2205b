"""Settings of a node agent (`kunlun-agent`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kunlun_common.trace_ring import ProfileOutput


@dataclass(frozen=True)
class ExecutorSettings:
    """How the agent runs, probes, restarts and stops the engines the scheduler assigns to its node."""

    health_path: str = "/health"
    """HTTP path probed on each engine (readiness, then liveness)."""
    probe_interval_s: float = 1.0
    """Seconds between probes (and between checks that the engine still runs)."""
    probe_timeout_s: float = 2.0
    """Deadline of one probe."""
    probe_failure_threshold: int = 3
    """A Running engine failing this many probes in a row is restarted."""
    startup_timeout_s: float = 900.0
    """An engine not healthy this long after its start is restarted (model download and load included)."""
    restart_backoff_s: float = 1.0
    """First delay before restarting an engine that ended; doubled after each restart in a row."""
    restart_backoff_max_s: float = 60.0
    """Longest delay between restarts."""
    backoff_reset_s: float = 120.0
    """An engine that ran this long before ending is restarted after the first delay again."""
    stop_grace_s: float = 3.0
    """SIGTERM to SIGKILL delay when stopping an engine."""
    disconnect_stop_s: float = 5.0
    """Stop every engine once no replica has acknowledged a heartbeat for this long (longer than an
    agent restart; with the fence slack and stop_grace_s below the node lease + the scheduler's
    node_not_ready_grace_seconds, 5 + 8 s by default, so an instance never runs on two nodes)."""
    allow_unsandboxed: bool = False
    """Run engines even when the node offers no isolation at all (no cgroup controller, no namespaces)."""
    test_engine_fallback: bool = False
    """When SGLang is not installed, serve `engine: sglang` workloads with kunlun-test-engine (demo, tests)."""
    engine_python: str = "python3"
    """Interpreter of the engines' Python environment (where SGLang is installed)."""
    engine_user: str | None = "kunlun-engine"
    """Unprivileged user the engines run as (created by `make install` and kunlun-installer); None
    or empty: the agent's own user (root for a root agent: logged loudly, shown in `node describe`).
    An agent that is not root cannot switch users: its engines run as its own user."""
    engine_seccomp: bool = True
    """Load the default-deny system-call allowlist into every engine; turn off only where the host
    lacks libseccomp (logged loudly, shown in `node describe`)."""
    engine_read_only_root: bool = True
    """Show engines the host file system read-only except their own folders, the model and cache;
    turn off only where the host cannot remount in a mount namespace (logged, shown)."""
    memory_limit_mb: int | None = None
    """Default host-memory limit of one instance (cgroup); the spec's env KUNLUN_MEMORY_LIMIT_MB wins."""
    cpu_cores: float | None = None
    """Default CPU limit of one instance in cores; the spec's env KUNLUN_CPU_CORES wins."""
    pids_max: int | None = 32768
    """Most tasks (processes and threads) in one instance's cgroup."""
    stop_engines_on_exit: bool = False
    """Stop the engines when the agent exits on SIGTERM/SIGINT (default: leave them for the next agent)."""
    require_signed_packages: bool = False
    """Launch from a model package only when its signature verifies with a trusted key (those in
    trusted_keys_dir and the cluster's); the cluster policy can require it on every node."""
    trusted_keys_dir: str = ""
    """Folder of trusted Ed25519 public keys (*.pub) for packages (and signed declarations)."""
    package_cache_mb: int = 100 * 1024
    """Most MiB of model packages (unpacked, and pulls in progress) kept on the node; unused ones are
    evicted least recently used first; 0: no limit."""
    package_pull_rate_mb_s: float = 0.0
    """Most MiB/s one package pull from the control plane receives; 0: no cap."""
    cgroup_parent: str = "kunlun"
    """Parent cgroup; instances live in `<parent>/<node>/<instance_id>` of each hierarchy."""


@dataclass(frozen=True)
class AgentSettings:
    """How an agent finds its replicas and paces its heartbeats."""

    config_path: str
    """The node's device-plugin-config.yaml."""
    endpoints: tuple[str, ...]
    """Replica addresses (host:port); the agent talks to one at a time and fails over in order."""
    cert_dir: str
    """Certificate folder: ca.crt and agent/<node>.crt/.key (the certificate names the node)."""
    state_dir: str
    """Where the agent keeps node-local state (stand-in tool state, shims, instance folders)."""
    heartbeat_interval_s: float = 1.0
    """How often a heartbeat (with device samples) is sent."""
    ack_timeout_s: float = 3.0
    """A replica that does not acknowledge a heartbeat within this long is left for the next."""
    connect_timeout_s: float = 5.0
    """Deadline for connecting and registering with one replica."""
    node_service_listen: str = ""
    """host:port the agent's NodeService (instance logs, for replicas) listens on; empty: the node's
    address and a free port."""
    metrics_listen: str = ""
    """host:port of the Prometheus exporter (HTTPS, client certificates of role `monitoring`); port 0
    picks a free one; empty: no exporter."""
    executor: ExecutorSettings = field(default_factory=ExecutorSettings)
    """Engines: probes, restarts, sandbox policy, stop on disconnect."""
    require_signed_config: bool = False
    """Load the device declaration only with a valid detached signature (`FILE.sig`) by a trusted key."""
    trusted_keys_dir: str = ""
    """Folder of trusted Ed25519 public keys (*.pub) for signed declarations."""
    profiling: ProfileOutput = field(default_factory=ProfileOutput)
    """Where run-time profiles go when the scheduler settings switch `advanced_profiling` on: folder,
    most files kept, most bytes per file (`--profile-dir` sets the folder)."""
