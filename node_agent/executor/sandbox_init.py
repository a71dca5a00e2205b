"""The sandbox init: pid 1 of an engine's PID namespace, inside its mount namespace.

Started by `unshare(1)` as `python -I -c <import init_main> --init CONFIG -- ARGV...` (see
`sandbox.py`, which builds the command line). It imports the standard library only (the seccomp
binding is loaded in the engine's child), so it starts fast. It builds the engine's file-system view
(`mount_view.py`: host read-only, private /tmp and /dev with /dev/shm, the agent's folders hidden,
the engine's own folders bound back), forks the engine in its working directory, drops every
privilege there (`confine.py`: user, capabilities, no_new_privs, seccomp), forwards signals to it,
reaps zombies, and reports the engine's real exit status as JSON lines on an inherited status fd.
`--probe` only says whether namespaces, mounts and read-only remounts work here (for
`detect_protections`).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from node_agent.executor import mount_view
from node_agent.executor.confine import drop_privileges

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
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 0x2, 0x4, 0x8


_mount = mount_view.mount


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


def _kept_under_tmp(candidates: Sequence[str]) -> list[str]:
    """Whole top-level folders under /tmp holding a folder the engine needs (e.g. a checkout and its
    .venv together): they stay visible in the private /tmp."""
    dirs = sorted({os.path.realpath(c) for c in candidates if c and os.path.isdir(c)})
    return sorted(
        {
            "/tmp/" + Path(d).relative_to("/tmp").parts[0]
            for d in dirs
            if Path(d).is_relative_to("/tmp") and d != "/tmp"
        }
    )


def _needed_folders(argv: Sequence[str]) -> list[str]:
    """Folders the engine needs to read: the interpreters' prefixes and libraries, the program's
    folder, PYTHONPATH entries, and folders of absolute paths on its command line."""
    import shutil

    out = [sys.prefix, sys.base_prefix, *os.environ.get("PYTHONPATH", "").split(":")]
    exe = shutil.which(argv[0]) if argv else None
    for path in [exe, os.path.realpath(exe)] if exe else []:
        folder = os.path.dirname(path)
        out.append(os.path.dirname(folder) if os.path.basename(folder) == "bin" else folder)
    for a in argv[1:]:
        if a.startswith("/") and not a.startswith(("/proc/", "/dev/", "/sys/")) and os.path.exists(a):
            out.append(a if os.path.isdir(a) else os.path.dirname(a))
    return [p for p in out if p and os.path.isdir(p)]


def _build_view(cfg: Mapping[str, Any], argv: Sequence[str]) -> None:
    """Build the engine's file-system view in this mount namespace (see `mount_view.py`)."""
    user = cfg.get("user")
    hidden = [os.path.realpath(h) for h in cfg.get("hidden", ())]
    writable = [cfg["workdir"], *cfg.get("writable", ())]
    needed = [p for p in _needed_folders(argv) if not any(Path(p).is_relative_to(h) for h in hidden)]
    wanted = [*writable, *cfg.get("readable", ()), *needed]
    # the outermost folder the engine user cannot traverse on the way to one it needs is replaced
    # by a bare tmpfs holding only what it needs (e.g. /root above a pyenv interpreter)
    blocked = {b for p in wanted if (b := mount_view.blocked_ancestor(os.path.realpath(p), user))}
    keep = mount_view.open_dirs(_kept_under_tmp([*wanted]) if cfg["private_tmp"] else [])
    fds = mount_view.open_dirs(wanted)
    try:
        if cfg.get("read_only_root"):
            skip = ["/proc", "/dev"] if cfg["private_tmp"] else ["/proc", "/dev", "/tmp", "/run/shm"]
            mount_view.remount_read_only(skip)
        if cfg["private_tmp"]:
            mount_view.mount(
                "tmpfs", "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, f"mode=1777,size={cfg['tmp_size']}"
            )
            mount_view.bind_back(keep, ())
        if cfg["private_dev"]:  # before the binds: folders under /dev/shm come back into the private one
            _setup_dev(cfg["devices"], cfg["shm_size"])
        sealed = [h for h in sorted({*hidden, *blocked}, key=len) if mount_view.hide(h)]
        mount_view.bind_back(fds, writable)
        mount_view.seal(sealed)
    finally:
        mount_view.close_all(keep)
        mount_view.close_all(fds)


def _exec_engine(argv: Sequence[str], workdir: str, cfg: Mapping[str, Any]) -> None:
    """In the forked child: drop every privilege and become the engine. Never returns."""
    try:
        os.setsid()
        os.chdir(workdir)  # by path: the writable bind, not the read-only mount below it
        for sig in (*FORWARDED_SIGNALS, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        drop_privileges(cfg.get("user"), bool(cfg.get("seccomp")))
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
        try:
            mount_view.remount_read_only(["/proc", "/dev"])
            result["read_only"] = True
        except OSError as exc:
            result["read_only"], result["read_only_error"] = False, str(exc)
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
        os.close(os.open(cfg["workdir"], os.O_RDONLY | os.O_DIRECTORY))
        _build_view(cfg, argv)
    except OSError as exc:
        print(f"kunlun-sandbox: setup failed: {exc}", file=sys.stderr, flush=True)
        report(event="error", message=f"sandbox setup failed: {exc}")
        return SETUP_FAILED_EXIT
    pid = os.fork()
    if pid == 0:
        if status_fd is not None:
            os.close(status_fd)
        _exec_engine(argv, cfg["workdir"], cfg)
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
