"""The engine's view of the file system, built by the sandbox init inside the engine's mount namespace.

Nothing here reaches the host: unshare(1) makes the namespace's mounts private first, and every
remount is a per-mount (`MS_BIND | MS_REMOUNT`) change of the namespace's own copy.

* `remount_read_only` makes every host mount read-only (except /proc, /dev and, when the engine
  has no private /tmp, /tmp and /dev/shm);
* `hide` mounts an empty, read-only tmpfs over a folder (the agent's certificate folder and state
  folder, and any folder the engine user could not traverse on the way to a path it needs);
* `bind_back` makes the engine's own folders appear again at their own paths: the writable ones
  (its working folder, its compilation cache) read-write, the readable ones (its interpreter, the
  model) read-only, all nosuid and nodev.

Standard library only (the init imports it before anything else).
"""

from __future__ import annotations

import ctypes
import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC = 0x20, 0x1000, 0x4000
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME, _MS_STRICTATIME = 0x400, 0x800, 0x200000, 0x1000000
_FLAG_NAMES = {
    "ro": MS_RDONLY,
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": _MS_NOATIME,
    "nodiratime": _MS_NODIRATIME,
    "relatime": _MS_RELATIME,
}


def mount(source: str, target: str, fstype: str, flags: int, data: str = "") -> None:
    """mount(2); raise OSError naming the target."""
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.mount(source.encode(), target.encode(), fstype.encode(), ctypes.c_ulong(flags), data.encode())
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype or source} on {target}: {os.strerror(err)}")


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/self/mountinfo."""

    mount_id: int
    """Mount id."""
    parent_id: int
    """Parent mount id."""
    dev: int
    """st_dev of the mounted file system."""
    mount_point: str
    """Absolute path of the mount point."""
    flags: int
    """Per-mount flags (MS_RDONLY, MS_NOSUID...)."""


def _unescape(field: str) -> str:
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts() -> list[MountEntry]:
    """This namespace's mounts, in mount order."""
    entries = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            major, minor = parts[2].split(":")
            flags = 0
            for opt in parts[5].split(","):
                flags |= _FLAG_NAMES.get(opt, 0)
            entries.append(
                MountEntry(
                    int(parts[0]),
                    int(parts[1]),
                    os.makedev(int(major), int(minor)),
                    _unescape(parts[4]),
                    flags,
                )
            )
    return entries


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def remount_read_only(keep_writable: Sequence[str]) -> list[str]:
    """Remount every visible mount read-only except those under `keep_writable`; return the mount
    points made read-only. A mount that is not reachable at its path (shadowed by a later mount) is
    skipped; any other failure raises OSError."""
    done = []
    for entry in mounts():
        if entry.flags & MS_RDONLY or _under(entry.mount_point, keep_writable):
            continue
        keep = entry.flags & (MS_NOSUID | MS_NODEV | MS_NOEXEC | _MS_NOATIME | _MS_NODIRATIME | _MS_RELATIME)
        try:
            mount("", entry.mount_point, "", MS_REMOUNT | MS_BIND | MS_RDONLY | keep)
        except OSError:
            try:
                visible = os.stat(entry.mount_point, follow_symlinks=False).st_dev == entry.dev
            except OSError:
                visible = False
            if visible:
                raise
            continue
        done.append(entry.mount_point)
    return done


def hide(path: str) -> bool:
    """Mount an empty tmpfs over the folder `path` (`seal` makes it read-only once the engine's own
    folders are bound back into it); False when there is no such folder."""
    try:
        if not stat.S_ISDIR(os.stat(path, follow_symlinks=False).st_mode):
            return False
    except FileNotFoundError:
        return False
    mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=755,size=64k")
    return True


def traversable(path: str, user: Mapping[str, Any] | None) -> bool:
    """Whether `user` (None: root) may search the folder `path`."""
    if user is None:
        return True
    st = os.stat(path)
    if st.st_uid == int(user["uid"]):
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid in {int(g) for g in user["groups"]}:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def blocked_ancestor(path: str, user: Mapping[str, Any] | None) -> str | None:
    """The outermost folder above `path` that `user` cannot traverse, or None."""
    parts = Path(path).parts
    for i in range(2, len(parts)):
        ancestor = str(Path(*parts[:i]))
        try:
            if not traversable(ancestor, user):
                return ancestor
        except OSError:
            return None
    return None


def open_dirs(paths: Iterable[str]) -> dict[str, int]:
    """Handles on the existing folders among `paths` (taken before anything is hidden), by real path."""
    fds: dict[str, int] = {}
    for p in paths:
        real = os.path.realpath(p)
        if real in fds or real == "/":
            continue
        try:
            fds[real] = os.open(real, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
    return fds


def bind_back(fds: Mapping[str, int], writable: Iterable[str]) -> None:
    """Bind each folder (by its handle) at its own path again, outermost first; writable ones
    read-write, the others read-only; all nosuid, nodev. A folder still visible as itself and not
    writable is left as it is."""
    rw = {os.path.realpath(w) for w in writable}
    for path in sorted(fds, key=lambda p: (p.count("/"), p)):
        fd = fds[path]
        want_rw = path in rw
        try:
            here = os.stat(path)
            same = (here.st_dev, here.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino)
        except FileNotFoundError:
            same = False
        if same and not want_rw:
            continue
        if not same:
            os.makedirs(path, mode=0o755, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", path, "", MS_BIND)
        flags = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | (0 if want_rw else MS_RDONLY)
        mount("", path, "", flags)


def seal(paths: Iterable[str]) -> None:
    """Make the tmpfs `hide` put on each path read-only (after `bind_back` filled it)."""
    for path in paths:
        mount("", path, "", MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)


def close_all(fds: Mapping[str, int]) -> None:
    """Close the handles `open_dirs` returned."""
    for fd in fds.values():
        os.close(fd)
