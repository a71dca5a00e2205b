"""The sandbox init: pid 1 of an engine's PID namespace, inside its mount namespace.

Started by `unshare(1)` as `python -I -c <import init_main> --init CONFIG -- ARGV...` (see
`sandbox.py`, which builds the command line). It imports the standard library only, so it starts
fast. It mounts a private /tmp and a private /dev (the allowed device nodes, /dev/shm), forks the
engine in its working directory (optionally as an unprivileged user), forwards signals to it, reaps
zombies, and reports the engine's real exit status as JSON lines on an inherited status fd.
`--probe` only says whether namespaces and mounts work here (for `detect_protections`).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import stat
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

FORWARDED_SIGNALS = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
SETUP_FAILED_EXIT = 125
"""Exit code of the init when it could not set the sandbox up (as runc/docker use 125)."""
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND = 0x2, 0x4, 0x8, 0x1000


def _mount(source: str, target: str, fstype: str, flags: int, data: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.mount(source.encode(), target.encode(), fstype.encode(), ctypes.c_ulong(flags), data.encode())
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype} on {target}: {os.strerror(err)}")


def _setup_dev(devices: Sequence[Mapping[str, Any]], shm_size: str) -> None:
    _mount("tmpfs", "/dev", "tmpfs", _MS_NOSUID | _MS_NOEXEC, "mode=755,size=1m")
    for d in devices:
        path = str(d["path"])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        kind = stat.S_IFCHR if d["kind"] == "c" else stat.S_IFBLK
        os.mknod(path, kind | 0o600, os.makedev(int(d["major"]), int(d["minor"])))
        os.chown(path, int(d["uid"]), int(d["gid"]))
        os.chmod(path, int(d["mode"]))
    os.mkdir("/dev/shm")
    _mount("tmpfs", "/dev/shm", "tmpfs", _MS_NOSUID | _MS_NODEV, f"mode=1777,size={shm_size}")
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"/dev/{name}")
    os.symlink("/proc/self/fd", "/dev/fd")


def _kept_under_tmp(workdir: str, argv: Sequence[str]) -> list[str]:
    """Directories under /tmp that must survive the private /tmp mount (outermost first, no nesting)."""
    import shutil

    candidates = [workdir, sys.prefix, sys.base_prefix, *os.environ.get("PYTHONPATH", "").split(":")]
    exe = shutil.which(argv[0]) if argv else None
    if exe:
        candidates += [os.path.dirname(exe), os.path.dirname(os.path.realpath(exe))]
    candidates += [
        a if os.path.isdir(a) else os.path.dirname(a)
        for a in argv[1:]
        if a.startswith("/tmp/") and os.path.exists(a)
    ]
    dirs = sorted({os.path.realpath(c) for c in candidates if c and os.path.isdir(c)})
    dirs = [d for d in dirs if Path(d).is_relative_to("/tmp") and d != "/tmp"]
    out: list[str] = []
    for d in dirs:  # sorted: a parent comes before its children
        if not any(Path(d).is_relative_to(o) for o in out):
            out.append(d)
    # keep whole top-level folders under /tmp (e.g. a checkout and its .venv together)
    return sorted({"/tmp/" + Path(d).relative_to("/tmp").parts[0] for d in out})


def _exec_engine(argv: Sequence[str], workdir_fd: int, user: Mapping[str, Any] | None) -> None:
    """In the forked child: become the engine. Never returns."""
    try:
        os.setsid()
        os.fchdir(workdir_fd)
        for sig in (*FORWARDED_SIGNALS, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        if user is not None:
            os.setgroups(list(user["groups"]))
            os.setgid(int(user["gid"]))
            os.setuid(int(user["uid"]))
        os.execvpe(argv[0], list(argv), dict(os.environ))
    except OSError as exc:
        os.write(2, f"kunlun-sandbox: cannot start {argv[0]}: {exc}\n".encode())
        os._exit(127 if exc.errno == errno.ENOENT else 126)


def init_main(args: Sequence[str]) -> int:
    """Entry point inside the namespaces: `--probe`, or `--init CONFIG -- ARGV...`."""
    if args and args[0] == "--probe":
        result: dict[str, Any] = {"pid": os.getpid()}
        try:
            _mount("tmpfs", "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m")
            result["mount"] = True
        except OSError as exc:
            result["mount"], result["error"] = False, str(exc)
        print(json.dumps(result))
        return 0
    if len(args) < 4 or args[0] != "--init" or args[2] != "--":
        print("usage: --init CONFIG -- ARGV... | --probe", file=sys.stderr)
        return 2
    cfg, argv = json.loads(args[1]), args[3:]
    status_fd: int | None = cfg.get("status_fd")

    def report(**event: Any) -> None:
        if status_fd is not None:
            try:
                os.write(status_fd, (json.dumps(event) + "\n").encode())
            except OSError:
                pass

    engine_pid = 0
    pending: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if engine_pid:
            try:
                os.kill(engine_pid, signum)
            except ProcessLookupError:
                pass
        else:
            pending.append(signum)

    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward)
    try:
        workdir_fd = os.open(cfg["workdir"], os.O_RDONLY | os.O_DIRECTORY)
        if cfg["private_tmp"]:
            # what lives under /tmp and the engine needs (its directory, its interpreter or virtual
            # environment, files named on its command line) stays visible in the private /tmp
            keep = {
                p: os.open(p, os.O_RDONLY | os.O_DIRECTORY) for p in _kept_under_tmp(cfg["workdir"], argv)
            }
            _mount("tmpfs", "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, f"mode=1777,size={cfg['tmp_size']}")
            for path, fd in keep.items():
                os.makedirs(path, exist_ok=True)
                _mount(f"/proc/self/fd/{fd}", path, "", _MS_BIND, "")
                os.close(fd)
        if cfg["private_dev"]:
            _setup_dev(cfg["devices"], cfg["shm_size"])
    except OSError as exc:
        print(f"kunlun-sandbox: setup failed: {exc}", file=sys.stderr, flush=True)
        report(event="error", message=f"sandbox setup failed: {exc}")
        return SETUP_FAILED_EXIT
    pid = os.fork()
    if pid == 0:
        if status_fd is not None:
            os.close(status_fd)
        _exec_engine(argv, workdir_fd, cfg.get("user"))
    engine_pid = pid
    report(event="started", ns_pid=pid)
    for signum in pending:
        forward(signum, None)
    code = SETUP_FAILED_EXIT
    while True:
        try:
            wpid, status = os.wait()
        except ChildProcessError:
            break
        if wpid == pid:
            code = os.waitstatus_to_exitcode(status)
            report(event="exited", exit_code=code if code >= 0 else None, signal=-code if code < 0 else None)
            break
    # As pid 1, returning makes the kernel SIGKILL whatever the engine left in the namespace.
    return code if code >= 0 else 128 - code
