"""Dropping an engine's privileges in the forked child, just before it becomes the engine.

Called by the sandbox init (namespaced engines) and by the supervisor's spawn (engines on a node
without namespaces). In order:

1. every capability leaves the bounding set (needs CAP_SETPCAP, so before the user switch) and the
   ambient set is cleared: no later execve can hand a capability back, not even to uid 0;
2. the supplementary groups, gid and uid become the engine user's (when one is given);
3. the permitted, effective and inheritable sets are emptied (a root engine keeps uid 0 but no
   capability);
4. `no_new_privs` is set: setuid/setgid binaries and file capabilities grant nothing on execve;
5. the seccomp filter (`seccomp_policy.py`), built first while root, is loaded when asked for.

Any failure raises OSError: the caller refuses to start the engine rather than run it less confined
than configured. Standard library only apart from the seccomp binding, imported when used.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from typing import Any

_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_CAP_SETPCAP = 8


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 40  # CAP_CHECKPOINT_RESTORE, the last one as of Linux 6.x


def _effective_caps() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def drop_privileges(user: Mapping[str, Any] | None, seccomp: bool) -> None:
    """Make this process an unprivileged engine (see the module docstring); raise OSError on failure."""
    libc = _libc()
    flt = None
    if seccomp:  # built while the modules it needs can still be read (before the user switch)
        from node_agent.executor.seccomp_policy import build_filter

        try:
            flt = build_filter()
        except RuntimeError as exc:
            raise OSError(f"building the seccomp filter: {exc}") from exc
    if _effective_caps() >> _CAP_SETPCAP & 1:
        for cap in range(_last_cap() + 1):
            rc = libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
            if rc != 0 and ctypes.get_errno() != 22:  # EINVAL: a capability this kernel lacks
                _check(rc, f"dropping capability {cap} from the bounding set")
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # EINVAL before Linux 4.3: none
    if user is not None:
        os.setgroups([int(g) for g in user["groups"]])
        os.setgid(int(user["gid"]))
        os.setuid(int(user["uid"]))
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(libc.capset(ctypes.byref(header), ctypes.byref(data)), "clearing the capability sets")
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "setting no_new_privs")
    if flt is not None:
        try:
            flt.load()
        except RuntimeError as exc:
            raise OSError(f"loading the seccomp filter: {exc}") from exc
