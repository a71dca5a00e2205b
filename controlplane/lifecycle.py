"""Leader loop: node lifecycle. Turns liveness (the `alive/<node>` lease keys) into recorded
Ready/NotReady transitions with timestamps (fenced writes), which later loops act on."""

from __future__ import annotations

import structlog

from controlplane import keys
from controlplane.election import Fence
from controlplane.store import EtcdStore, Resync
from kunlun_common.clock import now_ms

log = structlog.get_logger("node-lifecycle")


class NodeLifecycle:
    """Records node readiness transitions; one log line per transition."""

    def __init__(self, store: EtcdStore) -> None:
        self.store = store
        self.status: dict[str, bool] = {}

    async def _record(self, fence: Fence, node: str, ready: bool, reason: str) -> None:
        if self.status.get(node) == ready:
            return
        await fence.put(
            keys.node_status(node),
            keys.encode({"ready": ready, "since_ms": now_ms(), "reason": reason}),
        )
        self.status[node] = ready
        log.info("node readiness changed", node=node, ready=ready, reason=reason)

    async def _reconcile_all(self, fence: Fence, alive: set[str]) -> None:
        nodes, _ = await self.store.get_prefix(keys.NODES)
        statuses, _ = await self.store.get_prefix(keys.NODE_STATUS)
        self.status = {keys.last_segment(kv.key): bool(keys.decode(kv.value).get("ready")) for kv in statuses}
        for kv in nodes:
            name = keys.last_segment(kv.key)
            ready = name in alive
            await self._record(fence, name, ready, "agent connected" if ready else "node lease expired")

    async def run(self, fence: Fence) -> None:
        kvs, rev = await self.store.get_prefix(keys.ALIVE)
        alive = {keys.last_segment(kv.key) for kv in kvs}
        await self._reconcile_all(fence, alive)
        async for ev in self.store.watch_prefix(keys.ALIVE, rev + 1):
            if isinstance(ev, Resync):
                alive = {keys.last_segment(kv.key) for kv in ev.kvs}
                await self._reconcile_all(fence, alive)
                continue
            node = keys.last_segment(ev.kv.key)
            if ev.kind == "put":
                alive.add(node)
                await self._record(fence, node, True, "agent connected")
            else:
                alive.discard(node)
                await self._record(fence, node, False, "node lease expired")
