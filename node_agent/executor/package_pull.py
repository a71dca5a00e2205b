"""Pulling a model package from the cluster's package store, through the replicas (mTLS).

`PackagePuller.pull` fetches `NAME@sha256:HEX` with PackageService.PullPackage into
`<packages>/pulling/<hex>.partial`, chunk by chunk (1 MiB, the replica's PULL_CHUNK). Every chunk
is checked before it is kept: its offset, its length, and its SHA-256 against the digest the
replica recorded when it verified the package at push. A chunk that disagrees is refused (never
written) and the pull goes on from the next replica at the same offset.

Resuming: after each kept chunk the data is flushed to disk, then `<hex>.json` records the end of
the verified prefix (atomically). A cut link, a replica that dies, or an agent killed with
SIGKILL resumes from that offset, never from zero (bytes past it are truncated: they were not
verified). `fetched_bytes` in the record counts every byte received over all attempts; the final
record is kept as `<packages>/pulls/<hex>.json` (what was re-fetched, where it resumed, which
chunks were refused).

The whole package is verified afterwards (manifest digest, every file's hash, the signature per the
policy: `package_cache.py`); a pulled file that fails that is deleted.

Errors: `PullRefused` (permanent: no such package in the store) or `PullFailed` (retry later: no
replica could serve it now). Pacing: `rate_bytes_s` caps the pull's bandwidth (0: no cap).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog

from kunlun_common import tls
from kunlun_common.api import package_pb2, package_pb2_grpc
from kunlun_common.messages import Message, msg
from kunlun_common.retry import backoff_delay

log = structlog.get_logger("package-pull")
ROUNDS = 3
"""Passes over every replica endpoint before a pull gives up for now (the instance retries later)."""


class PullRefused(Exception):
    """The package cannot be pulled: retrying cannot help (the message says what to do)."""

    def __init__(self, message: str | Message) -> None:
        super().__init__(str(message))
        self.localizable: Message | None = message if isinstance(message, Message) else None


class PullFailed(Exception):
    """No replica could serve the package now; a later retry resumes where this one stopped."""

    def __init__(self, message: str | Message) -> None:
        super().__init__(str(message))
        self.localizable: Message | None = message if isinstance(message, Message) else None


class _ChunkRefused(Exception):
    pass


@dataclass(frozen=True)
class PullSettings:
    """How an agent pulls packages."""

    rate_bytes_s: float = 0.0
    """Most bytes per second one pull receives (0: as fast as the link allows)."""
    chunk_timeout_s: float = 30.0
    """A replica that sends no chunk for this long is left for the next."""


Progress = Callable[[int, int, str], None]
"""Told (verified bytes, total bytes, serving replica) after every kept chunk."""
Reserve = Callable[[int], None]
"""Told the package's total size before the first byte is written (may raise to refuse)."""


def _load_state(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save_state(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(state, sort_keys=True))
    os.replace(tmp, path)


def _prepare_partial(partial: Path, verified: int) -> int:
    """Truncate the partial file to its verified prefix; the prefix length actually on disk."""
    partial.parent.mkdir(parents=True, exist_ok=True)
    with partial.open("ab") as f:
        size = f.seek(0, os.SEEK_END)
        keep = min(size, verified)
        f.truncate(keep)
    return keep


def _write_at(partial: Path, offset: int, data: bytes) -> None:
    fd = os.open(partial, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
        os.fdatasync(fd)  # on disk before the state says it is verified
    finally:
        os.close(fd)


class PackagePuller:
    """Pulls packages from the replicas (see the module docstring)."""

    def __init__(
        self, endpoints: Sequence[str], material: tls.TlsMaterial, settings: PullSettings = PullSettings()
    ) -> None:
        self.endpoints = list(endpoints)
        self.creds = tls.channel_credentials(material)
        self.settings = settings

    def channel(self, ep: str) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(ep, self.creds)

    async def cluster_trust(self) -> tuple[bool, list[bytes]]:
        """(require_signed_packages, trusted public key PEMs) from the first replica that answers."""
        problems = []
        for ep in self.endpoints:
            async with self.channel(ep) as ch:
                stub = package_pb2_grpc.PackageServiceStub(ch)
                try:
                    policy = await stub.GetPackagePolicy(package_pb2.GetPackagePolicyRequest(), timeout=5)
                    keys = await stub.ListTrustedKeys(package_pb2.ListTrustedKeysRequest(), timeout=5)
                except grpc.aio.AioRpcError as e:
                    problems.append(f"{ep}: {e.code().name}: {e.details()}")
                    continue
            return policy.require_signed_packages, [k.public_key_pem.encode() for k in keys.keys]
        raise PullFailed(
            msg(
                "package.policy_unreadable",
                "cannot read the cluster's package policy and trusted keys: {problems}",
                problems="; ".join(problems),
            )
        )

    async def pull(
        self, ref: str, work: Path, dest: Path, progress: Progress, reserve: Reserve
    ) -> dict[str, Any]:
        """Pull `ref` into `dest` (see the module docstring); the pull's record."""
        hexd = ref.rsplit(":", 1)[-1]
        partial, state_path = work / f"{hexd}.partial", work / f"{hexd}.json"
        state = await asyncio.to_thread(_load_state, state_path)
        state.setdefault("ref", ref)
        state.setdefault("fetched_bytes", 0)
        state.setdefault("resumed_at", [])
        state.setdefault("refused_chunks", [])
        state["verified"] = await asyncio.to_thread(_prepare_partial, partial, int(state.get("verified", 0)))
        if "total" in state:  # resuming: the size is known already
            reserve(int(state["total"]))
        problems: list[str] = []
        for attempt in range(ROUNDS * len(self.endpoints)):
            ep = self.endpoints[attempt % len(self.endpoints)]
            if attempt and attempt % len(self.endpoints) == 0:
                await asyncio.sleep(backoff_delay(attempt // len(self.endpoints), 0.5, 5.0))
            try:
                await self._from(ep, ref, partial, state, state_path, progress, reserve)
            except _ChunkRefused as e:
                problems.append(f"{ep}: {e}")
                continue
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    raise PullRefused(
                        e.details() or msg("package.not_in_store", "not in the cluster store")
                    ) from None
                problems.append(f"{ep}: {e.code().name}: {e.details()}")
                log.warning(
                    "package pull interrupted", ref=ref, replica=ep, code=e.code().name, at=state["verified"]
                )
                continue
            except TimeoutError:
                problems.append(f"{ep}: no chunk for {self.settings.chunk_timeout_s:g}s")
                continue
            total = int(state["total"])
            if state["verified"] == total:
                await asyncio.to_thread(os.replace, partial, dest)
                await asyncio.to_thread(_finish, state_path, dest.parent.parent / "pulls", hexd, state)
                log.info(
                    "package pulled",
                    ref=ref,
                    bytes=total,
                    fetched=state["fetched_bytes"],
                    resumed_at=state["resumed_at"],
                    refused=len(state["refused_chunks"]),
                )
                return state
        raise PullFailed("; ".join(problems[-3:]) or msg("package.no_replica", "no replica endpoint"))

    async def _from(
        self,
        ep: str,
        ref: str,
        partial: Path,
        state: dict[str, Any],
        state_path: Path,
        progress: Progress,
        reserve: Reserve,
    ) -> None:
        """Receive chunks from one replica until the end or an error."""
        offset = int(state["verified"])
        if offset:
            state["resumed_at"].append(offset)
        started, received = time.monotonic(), 0
        async with self.channel(ep) as ch:
            call = package_pb2_grpc.PackageServiceStub(ch).PullPackage(
                package_pb2.PullPackageRequest(ref=ref, offset=offset)
            )
            while True:
                msg = await asyncio.wait_for(call.read(), self.settings.chunk_timeout_s)
                if msg is grpc.aio.EOF:  # type: ignore[attr-defined]
                    return
                assert isinstance(msg, package_pb2.PackageChunk)
                total = int(msg.total_bytes)
                if "total" not in state:
                    reserve(total)
                    state["total"] = total
                want = min(int(msg.chunk_size), total - offset)
                state["fetched_bytes"] += len(msg.data)
                bad = ""
                if total != state["total"] or msg.offset != offset:
                    bad = f"chunk at {msg.offset} (expected {offset} of {state['total']})"
                elif len(msg.data) != want or hashlib.sha256(msg.data).hexdigest() != msg.sha256:
                    bad = f"chunk {offset // max(1, msg.chunk_size)} at {offset}: SHA-256 does not match the digest recorded at push"
                if bad:
                    state["refused_chunks"].append({"offset": offset, "replica": msg.replica, "why": bad})
                    await asyncio.to_thread(_save_state, state_path, state)
                    log.warning("package chunk refused", ref=ref, replica=msg.replica, why=bad)
                    call.cancel()
                    raise _ChunkRefused(f"replica {msg.replica}: {bad}; refused")
                await asyncio.to_thread(_write_at, partial, offset, msg.data)
                offset += len(msg.data)
                state["verified"] = offset
                await asyncio.to_thread(_save_state, state_path, state)
                progress(offset, total, msg.replica)
                received += len(msg.data)
                if self.settings.rate_bytes_s > 0:
                    ahead = received / self.settings.rate_bytes_s - (time.monotonic() - started)
                    if ahead > 0:
                        await asyncio.sleep(ahead)


def _finish(state_path: Path, pulls: Path, hexd: str, state: dict[str, Any]) -> None:
    pulls.mkdir(parents=True, exist_ok=True)
    _save_state(pulls / f"{hexd}.json", state)
    state_path.unlink(missing_ok=True)
