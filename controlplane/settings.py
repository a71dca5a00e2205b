"""Settings of a control-plane replica (`kunlun-platform`), loadable from YAML and flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from controlplane.audit import AuditSettings
from controlplane.election import ElectionSettings
from kunlun_common.errors import ConfigError
from kunlun_common.messages import msg
from kunlun_common.pki import CertPaths, etcd_client_paths, paths_for
from kunlun_common.trace_ring import ProfileOutput


@dataclass(frozen=True)
class ReplicaSettings:
    """Everything one replica needs; YAML keys are these field names."""

    name: str
    """Replica name; must equal the CN of its certificate (role `replica`)."""
    cert_dir: str
    """Certificate folder: ca.crt, replica-ca.crt, replica/<name>.crt/.key, and for etcd
    etcd-ca.crt and etcd-client/kunlun.crt/.key (`kunlun-cli certs bundle` makes one)."""
    etcd_endpoints: tuple[str, ...]
    """etcd client URLs, e.g. https://127.0.0.1:2379 (all members)."""
    listen: str = "127.0.0.1:50051"
    """host:port the gRPC API listens on (default port 50051)."""
    advertise: str = ""
    """host:port that clients use to reach this replica (default: listen)."""
    etcd_server_name: str = ""
    """Name checked against the etcd members' certificates; default: the endpoints' host when
    they share one (members on several hosts need a name that all their certificates carry)."""
    election: ElectionSettings = field(default_factory=ElectionSettings)
    """Leader election timing."""
    node_lease_ttl_s: int = 5
    """A node whose agent is not heard for this long turns NotReady (its alive key is deleted; 1.5 x
    this while its stream stays open). With
    the scheduler's node_not_ready_grace_seconds it sets how soon a lost node's instances move (README
    "Node loss: the defaults and their arithmetic")."""
    replica_lease_ttl_s: int = 5
    """A replica that dies disappears from `cluster status` after this long."""
    telemetry_snapshot_s: float = 10.0
    """How often a node's coarse telemetry snapshot is written to etcd (samples stay in memory)."""
    heartbeat_ack_requires_etcd_s: float = 3.0
    """Heartbeats are acked only if the replica's liveness lease (which binds its nodes' alive keys)
    was refreshed within this many seconds, so an agent talking to a replica cut off from etcd moves
    to another replica. The liveness lease lives node_lease_ttl_s plus this, so the alive keys
    outlive the last ack by the node lease; it is refreshed every third of this, so acks keep
    flowing (one keep-alive per replica, whatever the number of agents)."""
    etcd_wait_s: float = 60.0
    """At start-up, wait this long for etcd (retrying with backoff, logging each try) before exiting
    non-zero; 0 waits forever."""
    etcd_quota_bytes: int = 2 * 1024**3
    """etcd's space quota (`--quota-backend-bytes`; the launcher sets 2 GiB), exported so that the
    near-quota alert compares the database size with it."""
    watch_heartbeat_s: float = 5.0
    """How often this replica rewrites its heartbeat key to time its own watch
    (`kunlun_replica_watch_lag_seconds`, controlplane/watch_lag.py); 0: never (no watch lag figure)."""
    metrics_listen: str = ""
    """host:port of the Prometheus exporter (HTTPS with the replica's certificate; client certificates of
    role `monitoring`); port 0 picks a free one; empty: no exporter."""
    log_level: str = "info"
    """debug, info, warning or error."""
    log_format: str = ""
    """`json` (one JSON object a line, for production), `console` (readable), or empty: JSON unless
    stderr is a terminal."""
    package_store_dir: str = ""
    """Folder of this replica's copies of model packages (`{name}` is replaced by the replica name);
    empty: this replica stores no packages (pushes go to replicas that do)."""
    package_store_quota_bytes: int = 200 * 2**30
    """Most bytes of packages the cluster's store index may hold (each package counted once)."""
    audit: AuditSettings = field(default_factory=AuditSettings)
    """Retention of the audit log (`kunlun-cli audit`): most records and oldest age kept."""
    profiling: ProfileOutput = field(default_factory=ProfileOutput)
    """Where run-time profiles go when the scheduler settings switch `advanced_profiling` on: folder,
    most files kept, most bytes per file (`--profile-dir` sets the folder)."""

    def __post_init__(self) -> None:
        if not self.etcd_endpoints:
            raise ConfigError(
                msg(
                    "replica.settings.no_etcd",
                    "etcd_endpoints: at least one etcd endpoint is required, e.g. https://127.0.0.1:2379",
                )
            )
        if ":" not in self.listen:
            raise ConfigError(
                msg("settings.listen", "listen: expected host:port, found {found!r}", found=self.listen)
            )
        if self.metrics_listen:
            host, sep, port = self.metrics_listen.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ConfigError(
                    msg(
                        "settings.metrics_listen",
                        "metrics_listen: expected host:port (port 0: a free one), found {found!r}",
                        found=self.metrics_listen,
                    )
                )
        if not self.watch_heartbeat_s >= 0:
            raise ConfigError(
                msg(
                    "replica.settings.watch_heartbeat",
                    "watch_heartbeat_s: expected a number of seconds >= 0 (0: off), found {found!r}",
                    found=self.watch_heartbeat_s,
                )
            )
        if self.node_lease_ttl_s < 3:
            raise ConfigError(
                msg(
                    "replica.settings.node_lease_ttl",
                    "node_lease_ttl_s: expected at least 3 seconds, found {found}",
                    found=self.node_lease_ttl_s,
                )
            )
        if self.log_format not in ("", "json", "console"):
            raise ConfigError(
                msg(
                    "settings.log_format",
                    "log_format: expected json or console, found {found!r}",
                    found=self.log_format,
                )
            )
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError(
                msg(
                    "settings.log_level",
                    "log_level: expected debug, info, warning or error, found {found!r}",
                    found=self.log_level,
                )
            )

    @property
    def advertise_address(self) -> str:
        return self.advertise or self.listen

    def cert_paths(self) -> CertPaths:
        """This replica's own certificate (replica CA) and the cluster CA it trusts for clients."""
        return paths_for(self.cert_dir, "replica", self.name)

    def etcd_cert_paths(self) -> CertPaths:
        """The etcd client certificate (CN `kunlun`) and the etcd CA."""
        return etcd_client_paths(self.cert_dir)
