"""Read the whole etcd history of a run (a watch from revision 1; auto-compaction is off during a
run) and turn it into what the checkers read: allocation changes and fenced leader writes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from chaos.invariants import AllocEvent, LeaderWrite
from controlplane import keys
from controlplane.store import EtcdStore, StoreSettings, WatchEvent
from kunlun_common.pki import CertPaths


@dataclass
class EtcdHistory:
    """What the history held."""

    allocs: list[AllocEvent] = field(default_factory=list)
    leader_writes: list[LeaderWrite] = field(default_factory=list)
    leaders: list[tuple[int, str]] = field(default_factory=list)
    """(revision, replica) of every election/leader put."""
    events: int = 0
    last_revision: int = 0
    complete: bool = True
    """False when etcd had compacted part of it (the checkers then cannot vouch for it)."""


async def read_history(endpoints: list[str], certs: CertPaths, timeout_s: float = 120.0) -> EtcdHistory:
    store = EtcdStore(StoreSettings(tuple(endpoints), str(certs.ca), str(certs.cert), str(certs.key)))
    h = EtcdHistory()
    try:
        end = await store.revision()
        h.last_revision = end
        async with asyncio.timeout(timeout_s):
            async for ev in store.watch_prefix(keys.ROOT, 1):
                if not isinstance(ev, WatchEvent):
                    h.complete = False
                    if ev.revision >= end:
                        break
                    continue
                h.events += 1
                k = ev.kv.key
                if k.startswith(keys.ALLOC):
                    inst = "" if ev.kind == "delete" else str(keys.decode(ev.kv.value).get("instance", ""))
                    h.allocs.append(
                        AllocEvent(ev.kv.mod_revision, keys.alloc_device(k), ev.kind, inst, ev.kv.version)
                    )
                elif k == keys.LEADER_STATE and ev.kind == "put":
                    h.leader_writes.append(
                        LeaderWrite(ev.kv.mod_revision, int(keys.decode(ev.kv.value)["epoch"]))
                    )
                elif k == keys.LEADER and ev.kind == "put":
                    h.leaders.append((ev.kv.mod_revision, str(keys.decode(ev.kv.value).get("name", ""))))
                if ev.kv.mod_revision >= end:
                    break
    finally:
        await store.close()
    return h
