"""The sandboxed engine command: own PID and mount namespaces, private /tmp and /dev, clean environment.

Python 3.11 has no `os.unshare`, so namespaces come from util-linux `unshare(1)`. The chain is::

    unshare --fork --kill-child=SIGKILL --pid --mount --mount-proc -- \\
        python -I -c <import init_main> --init <config json> -- <engine argv...>

* `unshare` forks the sandbox init, which is pid 1 of the new PID namespace and sees a freshly
  mounted /proc (so the engine, pid 2, cannot see the host's processes). `--kill-child` kills
  the namespace if `unshare` dies.
* The init (`init_main`, in `sandbox_init.py`) mounts a private tmpfs on /tmp and a private /dev holding
  only the allowed device nodes (null, zero, full, random, urandom, tty plus the allocated
  accelerator nodes) and a /dev/shm tmpfs, then forks the engine in its working directory,
  optionally as an unprivileged user. It forwards SIGTERM/SIGINT/SIGHUP/SIGQUIT/SIGUSR1/SIGUSR2
  to the engine, reaps zombies, and reports the engine's real exit status as JSON lines on an
  inherited status fd: util-linux 2.38 `unshare` does not propagate a child's death by signal
  (it exits 1), so the supervisor relies on that report.
* The environment is built from an allowlist of the parent's variables (PATH, LANG, LC_*, HOME,
  TZ...) plus what the device plugin returned plus what the spec asks for explicitly: nothing else
  leaks (no LD_LIBRARY_PATH, HIP_PATH, *_PROXY, credentials).

* In the engine's child the init drops every privilege (`confine.py`): the engine user, no
  capabilities, no_new_privs, the seccomp allowlist; the host file system is read-only in its view
  except its own folders, and the agent's folders are hidden (`mount_view.py`). On a node without
  namespaces the supervisor drops the privileges itself before exec.

Allocated device nodes that do not exist on this host (simulated devices) are skipped and
reported in `SandboxedCommand.skipped_devices`.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from kunlun_common.errors import ConfigError
from node_agent.executor.sandbox_init import FORWARDED_SIGNALS as FORWARDED_SIGNALS
from node_agent.executor.sandbox_init import SETUP_FAILED_EXIT as SETUP_FAILED_EXIT
from node_agent.executor.sandbox_init import init_main as init_main
from node_agent.executor.seccomp_policy import available as seccomp_available

if TYPE_CHECKING:
    from node_agent.executor.cgroups import CgroupLayout

log = structlog.get_logger(__name__)

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_ENV_ALLOWLIST = (
    "PATH",
    "LANG",
    "LANGUAGE",
    "HOME",
    "TZ",
    "TERM",
    "USER",
    "LOGNAME",
    "PYTHONUNBUFFERED",
    "PYTHONIOENCODING",
)
DEFAULT_BASE_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class SandboxSettings:
    """Which protections to apply to engines on this node."""

    pid_namespace: bool = True
    """Run the engine in its own PID namespace (it cannot see or signal host processes)."""
    mount_namespace: bool = True
    """Run the engine in its own mount namespace (needed for a private /tmp, /dev and /proc)."""
    private_tmp: bool = True
    """Mount a private tmpfs on /tmp."""
    tmp_size: str = "1g"
    """Size limit of the private /tmp (tmpfs `size=` syntax); its pages count against the cgroup."""
    private_dev: bool = True
    """Mount a private /dev holding only the base and the allocated device nodes."""
    shm_size: str = "50%"
    """Size limit of the private /dev/shm (engines use it for inter-process tensors)."""
    base_devices: tuple[str, ...] = DEFAULT_BASE_DEVICES
    """Device nodes every engine gets in its private /dev."""
    env_allowlist: tuple[str, ...] = DEFAULT_ENV_ALLOWLIST
    """Parent variables passed through to the engine."""
    env_allow_prefixes: tuple[str, ...] = ("LC_",)
    """Parent variables starting with one of these prefixes are passed through too."""
    unshare: str = "unshare"
    """The util-linux unshare(1) binary (name looked up on PATH, or a path)."""
    python: str = sys.executable
    """Interpreter that runs the sandbox init inside the namespaces."""
    read_only_root: bool = True
    """Show the engine the host file system read-only (in its mount namespace), except its own
    folders (working folder, cache: read-write) and a private /tmp, /dev/shm."""
    hidden_paths: tuple[str, ...] = ()
    """Folders replaced by an empty read-only tmpfs in the engine's view (the agent sets its
    certificate and state folders; the engine's own folders under them are bound back)."""
    seccomp: bool = True
    """Load the default-deny system-call allowlist (`seccomp_policy.py`) into the engine."""

    def uses_namespaces(self) -> bool:
        """Whether the engine is started through unshare and the sandbox init."""
        return self.pid_namespace or self.mount_namespace

    def restricted_to(self, protections: Protections) -> SandboxSettings:
        """A copy with every protection the node lacks switched off."""
        mount_ns = self.mount_namespace and protections.mount_namespace
        return replace(
            self,
            pid_namespace=self.pid_namespace and protections.pid_namespace,
            mount_namespace=mount_ns,
            private_tmp=self.private_tmp and mount_ns and protections.private_dev,
            private_dev=self.private_dev and mount_ns and protections.private_dev,
            read_only_root=self.read_only_root and mount_ns and protections.read_only_root,
            hidden_paths=self.hidden_paths if mount_ns and protections.private_dev else (),
            seccomp=self.seccomp and protections.seccomp,
        )


@dataclass(frozen=True)
class Protections:
    """What this node can enforce, as reported by the agent (see `detect_protections`)."""

    cgroup_memory: bool
    """A writable memory controller (memory limit, OOM accounting)."""
    cgroup_pids: bool
    """A writable pids controller (task limit)."""
    cgroup_cpu: bool
    """A writable cpu controller (CPU bandwidth limit)."""
    pid_namespace: bool
    """unshare(1) can give the engine its own PID namespace."""
    mount_namespace: bool
    """unshare(1) can give the engine its own mount namespace."""
    private_dev: bool
    """The sandbox init can mount a private /dev and /tmp inside that mount namespace."""
    env_allowlist: bool = True
    """The engine environment is built from an allowlist (always available)."""
    notes: tuple[str, ...] = ()
    """Why a protection is missing, for the operator."""
    read_only_root: bool = False
    """The sandbox init can remount the host file system read-only in the engine's namespace."""
    seccomp: bool = False
    """A seccomp filter can be built here (pyseccomp and the system's libseccomp.so.2)."""

    def isolating(self) -> bool:
        """Whether any real isolation (cgroups or namespaces) is available; the env allowlist alone is not."""
        return any(
            (
                self.cgroup_memory,
                self.cgroup_pids,
                self.cgroup_cpu,
                self.pid_namespace,
                self.mount_namespace,
                self.private_dev,
            )
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for status reports."""
        return asdict(self)


@dataclass(frozen=True)
class UserIds:
    """The unprivileged identity an engine runs as."""

    uid: int
    """User id."""
    gid: int
    """Primary group id."""
    groups: tuple[int, ...]
    """Supplementary group ids (e.g. the group owning accelerator device nodes)."""
    home: str
    """Home directory, exported as HOME."""


@dataclass(frozen=True)
class DeviceNode:
    """A device node to recreate in the private /dev (copied from the host's node)."""

    path: str
    """Absolute path under /dev, e.g. /dev/davinci0."""
    kind: str
    """'c' for a character device, 'b' for a block device."""
    major: int
    """Device major number."""
    minor: int
    """Device minor number."""
    mode: int
    """Permission bits."""
    uid: int
    """Owner uid."""
    gid: int
    """Owner gid."""


@dataclass(frozen=True)
class SandboxRequest:
    """What one engine needs from the sandbox."""

    argv: tuple[str, ...]
    """The engine command line."""
    workdir: Path
    """The engine's own working directory (created by the caller)."""
    plugin_env: Mapping[str, str] = field(default_factory=dict)
    """Variables returned by the device plugin (and the launch plan); they win over `spec_env`."""
    spec_env: Mapping[str, str] = field(default_factory=dict)
    """Variables the workload spec asks for explicitly."""
    device_nodes: tuple[str, ...] = ()
    """Allocated device nodes to expose in the private /dev."""
    user: str | None = None
    """Run the engine as this user (name, uid or uid:gid); None keeps the agent's user."""
    writable_paths: tuple[str, ...] = ()
    """Folders besides `workdir` the engine may write (its compilation cache)."""
    readable_paths: tuple[str, ...] = ()
    """Folders the engine must read even under a hidden folder (its model package)."""


@dataclass(frozen=True)
class SandboxedCommand:
    """The exact process to start for an engine."""

    argv: tuple[str, ...]
    """Command line to execute (unshare + init + engine, or the bare engine when unsandboxed)."""
    env: Mapping[str, str]
    """The engine's complete environment."""
    cwd: Path
    """Working directory."""
    namespaced: bool
    """True when argv starts the sandbox init, which reports the engine status on the status fd."""
    user: UserIds | None
    """Identity to switch to (done by the init when namespaced, by the spawner otherwise)."""
    devices: tuple[DeviceNode, ...]
    """Device nodes created in the private /dev."""
    skipped_devices: tuple[str, ...]
    """Requested device nodes that do not exist here (simulated devices) and were left out."""


def build_env(
    parent_env: Mapping[str, str],
    plugin_env: Mapping[str, str],
    spec_env: Mapping[str, str],
    settings: SandboxSettings,
    user: UserIds | None = None,
) -> dict[str, str]:
    """Allowlisted parent variables, then the spec's, then the plugin's (which win on conflict)."""
    env = {
        k: v
        for k, v in parent_env.items()
        if k in settings.env_allowlist or k.startswith(settings.env_allow_prefixes)
    }
    env.setdefault("PATH", DEFAULT_PATH)
    if user is not None:
        env["HOME"] = user.home
        name = _user_name(user.uid)
        if name:
            env["USER"] = env["LOGNAME"] = name
    env.update(spec_env)
    for key, value in plugin_env.items():
        if key in spec_env and spec_env[key] != value:
            log.warning("sandbox.env_conflict", variable=key, kept="plugin")
        env[key] = value
    return env


def _user_name(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def resolve_user(spec: str) -> UserIds:
    """Resolve "name", "uid" or "uid:gid" to ids; raise ConfigError for an unknown user."""
    name, _, gid_text = spec.partition(":")
    try:
        entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    except (KeyError, ValueError) as exc:
        if name.isdigit():
            uid = int(name)
            gid = int(gid_text) if gid_text.isdigit() else uid
            return UserIds(uid, gid, (gid,), "/")
        raise ConfigError(f"engine user {spec!r} does not exist on this node") from exc
    gid = int(gid_text) if gid_text.isdigit() else entry.pw_gid
    groups = tuple(sorted({gid, *os.getgrouplist(entry.pw_name, gid)}))
    return UserIds(entry.pw_uid, gid, groups, entry.pw_dir)


def resolve_device_nodes(paths: Iterable[str]) -> tuple[tuple[DeviceNode, ...], tuple[str, ...]]:
    """Stat each requested node on the host; return (nodes to create, paths skipped as absent)."""
    nodes: list[DeviceNode] = []
    skipped: list[str] = []
    for path in dict.fromkeys(paths):
        if not path.startswith("/dev/") or ".." in path.split("/"):
            raise ConfigError(f"device node {path!r} must be an absolute path under /dev")
        try:
            st = os.stat(path)
        except FileNotFoundError:
            skipped.append(path)
            continue
        if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            kind = "c" if stat.S_ISCHR(st.st_mode) else "b"
            nodes.append(
                DeviceNode(
                    path,
                    kind,
                    os.major(st.st_rdev),
                    os.minor(st.st_rdev),
                    stat.S_IMODE(st.st_mode),
                    st.st_uid,
                    st.st_gid,
                )
            )
        else:
            skipped.append(path)
    return tuple(nodes), tuple(skipped)


def _init_prefix(settings: SandboxSettings, mode: str) -> list[str]:
    """unshare(1) + the interpreter running this module's init (or probe) inside the namespaces."""
    cmd = [settings.unshare, "--fork", "--kill-child=SIGKILL"]
    if settings.pid_namespace:
        cmd.append("--pid")
    if settings.mount_namespace:
        cmd.append("--mount")
        if settings.pid_namespace:
            cmd.append("--mount-proc")
    code = (
        f"import sys; sys.path.insert(0, {str(_PACKAGE_ROOT)!r}); "
        "from node_agent.executor.sandbox_init import init_main; sys.exit(init_main(sys.argv[1:]))"
    )
    return [*cmd, "--", settings.python, "-I", "-c", code, mode]


def build_sandboxed_command(
    request: SandboxRequest,
    settings: SandboxSettings,
    status_fd: int | None = None,
    parent_env: Mapping[str, str] | None = None,
) -> SandboxedCommand:
    """Build the process for `request`; `status_fd` is the pipe the init reports the engine status on."""
    if not request.argv:
        raise ConfigError("engine command line is empty")
    if (settings.private_dev or settings.private_tmp) and not settings.mount_namespace:
        raise ConfigError("private /dev and /tmp need mount_namespace = true")
    user = resolve_user(request.user) if request.user else None
    env = build_env(
        os.environ if parent_env is None else parent_env,
        request.plugin_env,
        request.spec_env,
        settings,
        user,
    )
    if settings.read_only_root and settings.mount_namespace:
        # the engine user's home is read-only (or absent) in its view: HOME is its working folder
        if "HOME" not in request.spec_env and "HOME" not in request.plugin_env:
            env["HOME"] = str(request.workdir)
    if not settings.uses_namespaces():
        return SandboxedCommand(tuple(request.argv), env, request.workdir, False, user, (), ())
    devices: tuple[DeviceNode, ...] = ()
    skipped: tuple[str, ...] = ()
    if settings.private_dev:
        devices, skipped = resolve_device_nodes([*settings.base_devices, *request.device_nodes])
        for path in skipped:
            log.warning("sandbox.device_skipped", device=path, note="absent on this host (simulated device?)")
    config = {
        "workdir": str(request.workdir),
        "private_tmp": settings.private_tmp,
        "tmp_size": settings.tmp_size,
        "private_dev": settings.private_dev,
        "shm_size": settings.shm_size,
        "devices": [asdict(d) for d in devices],
        "user": asdict(user) if user else None,
        "status_fd": status_fd,
        "read_only_root": settings.read_only_root and settings.mount_namespace,
        "hidden": list(settings.hidden_paths) if settings.mount_namespace else [],
        "writable": list(request.writable_paths),
        "readable": list(request.readable_paths),
        "seccomp": settings.seccomp,
    }
    argv = (*_init_prefix(settings, "--init"), json.dumps(config), "--", *request.argv)
    return SandboxedCommand(argv, env, request.workdir, True, user, devices, skipped)


def detect_protections(
    settings: SandboxSettings | None = None,
    layout: CgroupLayout | None = None,
    timeout_s: float = 10.0,
) -> Protections:
    """Probe what this node can enforce: cgroup controllers, PID/mount namespaces, private /dev."""
    from node_agent.executor.cgroups import detect_layout

    settings = settings or SandboxSettings()
    layout = layout if layout is not None else detect_layout()
    notes: list[str] = []
    cg: dict[str, bool] = {}
    for ctrl in ("memory", "pids", "cpu"):
        mount = layout.get(ctrl)
        cg[ctrl] = mount is not None and os.access(mount.mount_point, os.W_OK)
        if not cg[ctrl]:
            notes.append(f"cgroup {ctrl} controller " + ("absent" if mount is None else "not writable"))
    pid_ns = mount_ns = private_dev = read_only = False
    # loading libseccomp takes a while on a busy host: done beside the namespace probe (agent start-up
    # time counts against the engines' self-fencing deadline after an agent restart)
    seccomp_check = ThreadPoolExecutor(1, thread_name_prefix="seccomp-probe")
    seccomp_future = seccomp_check.submit(seccomp_available)
    if shutil.which(settings.unshare) is None:
        notes.append(f"{settings.unshare} not found: no namespaces")
    else:
        probe = replace(settings, pid_namespace=True, mount_namespace=True)
        try:
            out = subprocess.run(
                _init_prefix(probe, "--probe"), capture_output=True, timeout=timeout_s, check=False
            )
            result = json.loads(out.stdout or b"{}") if out.returncode == 0 else {}
        except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
            result, out = {}, None
            notes.append(f"namespace probe failed: {exc}")
        if out is not None and out.returncode != 0:
            notes.append(f"unshare failed: {out.stderr.decode(errors='replace').strip()[:200]}")
        pid_ns = result.get("pid") == 1
        mount_ns = bool(result)
        private_dev = bool(result.get("mount"))
        if result and not private_dev:
            notes.append(f"cannot mount tmpfs in the namespace: {result.get('error')}")
        read_only = bool(result.get("read_only"))
        if result and not read_only:
            notes.append(f"cannot remount the host file system read-only: {result.get('read_only_error')}")
    seccomp_problem = seccomp_future.result()
    seccomp_check.shutdown()
    if seccomp_problem:
        notes.append(seccomp_problem)
    return Protections(
        cg["memory"],
        cg["pids"],
        cg["cpu"],
        pid_ns,
        mount_ns,
        private_dev,
        True,
        read_only_root=read_only,
        seccomp=seccomp_problem is None,
        notes=tuple(notes),
    )


def require_protections(protections: Protections, allow_unsandboxed: bool) -> None:
    """Refuse to run engines on a node with no isolation at all unless the operator allowed it."""
    if not protections.isolating() and not allow_unsandboxed:
        raise ConfigError(
            "no sandbox protection is available on this node (no cgroup controller, no namespaces): "
            + "; ".join(protections.notes)
            + ". Fix the node or start the agent with --allow-unsandboxed"
        )
