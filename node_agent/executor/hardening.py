"""How this node confines its engines: the effective sandbox settings, the engine user, and what
`kunlun-cli node describe` shows about them.

Everything is on by default: a dedicated unprivileged user (`kunlun-engine`, created by the install
step), no capabilities and `no_new_privs` (always: every supported kernel has them), the seccomp
allowlist, a read-only host file system, the agent's certificate and state folders hidden. A
protection is off only when the operator turned it off (`--engine-user ''`, `--no-engine-seccomp`,
`--no-engine-read-only-root`) or the host cannot provide it; either way the agent logs an error at
start and the node's protections list it as `off:NAME (why)`.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, replace
from pathlib import Path

import structlog

from kunlun_common.errors import ConfigError
from node_agent.executor.sandbox import Protections, SandboxSettings, resolve_user
from node_agent.settings import ExecutorSettings

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class EngineHardening:
    """The node's effective engine confinement."""

    sandbox: SandboxSettings
    """Sandbox settings restricted to what the node can enforce."""
    engine_user: str | None
    """User the supervisor switches engines to; None: they keep the agent's user."""
    names: tuple[str, ...]
    """Protection names for the node's report, including `off:...` entries."""


def plan_hardening(
    ex: ExecutorSettings, protections: Protections, hidden: tuple[str, ...], euid: int | None = None
) -> EngineHardening:
    """Effective settings from the operator's `ex` and the node's `protections`; raise ConfigError
    when the engine user does not exist (naming the fix)."""
    euid = os.geteuid() if euid is None else euid
    wanted = SandboxSettings(
        read_only_root=ex.engine_read_only_root,
        seccomp=ex.engine_seccomp,
        hidden_paths=tuple(os.path.realpath(h) for h in hidden if h),
    )
    sandbox = wanted.restricted_to(protections)
    names: list[str] = []
    off: list[str] = []
    user: str | None = None
    if euid != 0:
        names.append(f"engine-user:uid-{euid} (the agent's own, not root)")
    elif ex.engine_user:
        try:
            ids = resolve_user(ex.engine_user)
        except ConfigError:
            raise ConfigError(
                f"--engine-user: user {ex.engine_user!r} does not exist on this node; create it "
                "(`make install` or kunlun-installer does), or pass --engine-user '' to run engines as "
                "root (not recommended)"
            ) from None
        if ids.uid == 0:
            off.append(f"off:engine-user (--engine-user {ex.engine_user} is root)")
        else:
            user = ex.engine_user
            names.append(f"engine-user:{ex.engine_user}")
    else:
        off.append("off:engine-user (--engine-user '': engines run as root)")
    names += ["no-capabilities", "no-new-privs"]
    for flag, name, asked, have in (
        ("--no-engine-seccomp", "seccomp", ex.engine_seccomp, sandbox.seccomp),
        ("--no-engine-read-only-root", "read-only-root", ex.engine_read_only_root, sandbox.read_only_root),
    ):
        if have:
            names.append(name)
        else:
            off.append(f"off:{name} ({'unavailable on this host' if asked else flag})")
    if sandbox.hidden_paths:
        names.append("hidden-agent-folders")
    else:
        off.append("off:hidden-agent-folders (no private mount namespace)")
    for entry in off:
        log.error("engine protection off", protection=entry, notes=list(protections.notes))
    return EngineHardening(sandbox, user, tuple(names + off))


def protect_key_folder(cert_dir: str, *paths: Path) -> list[str]:
    """Take every permission for others off the certificate folder and `paths` (the agent's key and
    its folder); a root agent only; return what was changed."""
    changed: list[str] = []
    if os.geteuid() != 0:
        return changed
    for path in (Path(cert_dir), *paths):
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
        except FileNotFoundError:
            continue
        if mode & 0o007:
            path.chmod(mode & ~0o007)
            changed.append(f"{path}: {mode:o} -> {mode & ~0o007:o}")
    for change in changed:
        log.warning("certificate permissions tightened (engines must never read them)", change=change)
    return changed


def with_engine_user(ex: ExecutorSettings, hardening: EngineHardening) -> ExecutorSettings:
    """`ex` with the engine user the supervisor actually switches to."""
    return replace(ex, engine_user=hardening.engine_user)
