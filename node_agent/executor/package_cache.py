"""The node-local package cache: pull (through the control plane), verify, unpack, evict.

Layout of `<state_dir>/packages/`:

* `incoming/`: .kunlunpkg files an operator copied in by hand (offline nodes); used as they are.
* `pulling/<hex>.partial` + `<hex>.json`: a pull in progress (package_pull.py); `pulled/<hex>.kunlunpkg`
  a finished pull, deleted once unpacked; `pulls/<hex>.json` what each finished pull cost.
* `unpacked/<hex>/`: verified packages (`.verified` holds the signer and the size); its mtime is
  the package's last use.

Before a package is used, the agent asks the cluster for the package policy and the trusted keys
(PackageService.GetPackagePolicy/ListTrustedKeys): `require_signed_packages` is on when the cluster
policy or the agent's own flag says so, and the trusted keys are the cluster's plus the agent's
`--trusted-keys` folder. A package already unpacked is checked again against them (a key removed
from the cluster, or a policy switched on, takes effect at the next launch).

Size limit: `limit_bytes` covers unpacked packages and pulls. Before a pull the cache makes room for
twice the package (the pulled file and its unpacked copy) by deleting the least recently used
unpacked packages that no assigned instance names; when that is not enough the launch waits
(a temporary error naming what holds the space). One lock per digest: two instances of the same
package pull and unpack it once.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from kunlun_common.messages import Message, msg, of_error
from kunlun_common.modelpkg import TrustedKeys
from node_agent.executor import packages
from node_agent.executor.package_pull import PackagePuller, PullFailed, PullRefused

log = structlog.get_logger("package-cache")
MIB = 1 << 20


class CacheFull(Exception):
    """Not enough room now; it frees up when instances stop using packages."""

    def __init__(self, message: str | Message) -> None:
        super().__init__(str(message))
        self.localizable: Message | None = message if isinstance(message, Message) else None


@dataclass
class PackageCache:
    """One node's package cache (see the module docstring)."""

    root: Path
    """`<state_dir>/packages`."""
    limit_bytes: int
    """Most bytes of packages (unpacked and being pulled) kept on the node; 0: no limit."""
    puller: PackagePuller | None
    """How packages missing from the node are fetched (None: only `incoming/`)."""
    in_use: Callable[[], set[str]]
    """Hex digests of the packages the node's assigned instances name (never evicted)."""
    require_signed: bool = False
    """The agent's own `--require-signed-packages`."""
    trusted_keys_dir: str = ""
    """The agent's own `--trusted-keys` folder."""
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    async def trust(self) -> tuple[bool, TrustedKeys]:
        """(signature required, trusted keys): the agent's own and the cluster's."""
        local = TrustedKeys.load([], [Path(self.trusted_keys_dir)] if self.trusted_keys_dir else [])
        if self.puller is None:
            return self.require_signed, local
        required, pems = await self.puller.cluster_trust()
        cluster = TrustedKeys.from_pems(pems)
        return self.require_signed or required, TrustedKeys({**local.keys, **cluster.keys})

    async def resolve(self, ref: str, progress: Callable[[Message], None]) -> packages.Unpacked:
        """The verified, unpacked package `ref`, pulled first when the node lacks it.

        Raises PackageRefused (permanent), PullFailed or CacheFull (retry later)."""
        packages.check_ref(ref)
        hexd = ref.rsplit(":", 1)[-1]
        lock = self._locks.setdefault(hexd, asyncio.Lock())
        async with lock:
            required, trusted = await self.trust()
            have = await asyncio.to_thread(self._have, ref, required)
            if not have:
                if self.puller is None:
                    raise packages.PackageRefused(packages.not_here(self.root / "incoming"))
                await self._pull(ref, hexd, progress)
            progress(msg("package.verifying", "verifying package {name}", name=ref.split("@")[0]))
            out = await asyncio.to_thread(packages.unpack_verified, self.root, ref, trusted, required)
            await asyncio.to_thread(_touch, self.root / "unpacked" / hexd / packages.MARKER)
            return out

    def _have(self, ref: str, required: bool) -> bool:
        hexd = ref.rsplit(":", 1)[-1]
        unpacked = self.root / "unpacked" / hexd
        if (unpacked / packages.MARKER).is_file() and (not required or packages.signature_checked(unpacked)):
            return True
        try:
            packages.find(self.root, *ref.split("@", 1))
        except packages.PackageRefused:
            return False
        return True

    async def _pull(self, ref: str, hexd: str, progress: Callable[[Message], None]) -> None:
        assert self.puller is not None
        name = ref.split("@")[0]
        shown = [-1]

        def report(done: int, total: int, replica: str) -> None:
            pct = 100 * done // max(total, 1)
            if pct != shown[0]:
                shown[0] = pct
                progress(
                    msg(
                        "package.pulling_progress",
                        "pulling package {name}: {pct}% ({done:.1f} of {total:.1f} MiB, from {replica})",
                        name=name,
                        pct=pct,
                        done=done / MIB,
                        total=total / MIB,
                        replica=replica,
                    )
                )

        def reserve(total: int) -> None:
            self._make_room(2 * total, hexd)

        dest = self.root / "pulled" / f"{hexd}.kunlunpkg"
        await asyncio.to_thread(dest.parent.mkdir, parents=True, exist_ok=True)
        progress(msg("package.pulling", "pulling package {name}", name=name))
        try:
            await self.puller.pull(ref, self.root / "pulling", dest, report, reserve)
        except PullRefused as e:
            raise packages.PackageRefused(of_error(e)) from None

    # ------------------------------------------------------------------ size limit

    def _make_room(self, need: int, keep: str) -> None:
        """Evict least recently used, unassigned unpacked packages until `need` more bytes fit."""
        if self.limit_bytes <= 0:
            return
        in_use = self.in_use() | {keep}
        entries = []
        for d in (self.root / "unpacked").iterdir() if (self.root / "unpacked").is_dir() else []:
            marker = d / packages.MARKER
            if d.is_dir() and marker.is_file():
                entries.append((marker.stat().st_mtime, d, packages.unpacked_bytes(d)))
        pending = sum(
            f.stat().st_size
            for sub in ("pulling", "pulled")
            for f in ((self.root / sub).glob("*") if (self.root / sub).is_dir() else [])
            if f.is_file() and not f.name.startswith(keep)
        )
        used = pending + sum(size for _, _, size in entries)
        for _, d, size in sorted(entries, key=lambda e: e[0]):
            if used + need <= self.limit_bytes:
                break
            if d.name in in_use:
                continue
            log.info("package evicted", digest=d.name, bytes=size, limit=self.limit_bytes)
            shutil.rmtree(d, ignore_errors=True)
            used -= size
        if used + need > self.limit_bytes:
            held = sorted(d.name[:12] for _, d, _ in entries if d.exists())
            raise CacheFull(
                msg(
                    "package.cache_full",
                    "package cache full: needs {need:.1f} MiB, {used:.1f} of {limit:.1f} MiB held by packages "
                    "in use ({held}); waiting for instances to stop using them, or raise the agent's "
                    "--package-cache-mb",
                    need=need / MIB,
                    used=used / MIB,
                    limit=self.limit_bytes / MIB,
                    held=", ".join(held) or "pulls",
                )
            )


def _touch(path: Path) -> None:
    try:
        os.utime(path, (time.time(), time.time()))
    except OSError:
        pass


__all__ = ["CacheFull", "PackageCache", "PullFailed", "PullRefused"]
