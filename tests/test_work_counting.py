"""Work counting: what one change costs a replica must not grow with the cluster.

Counters in the code (`GraphCache.work`), not timings: the same change is applied to a replica's
feeds (with one live assignment stream per node and the leader's incremental scheduler state)
holding 100 and 1,000 nodes, and it must cost exactly the same number of record decodes, index
lookups, wake-ups and stream sends. A scan over the nodes, the instances or the streams in a
change path shows up as a difference between the two sizes.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from controlplane import keys
from controlplane.api.agent_service import AgentService
from controlplane.feeds import Feeds
from controlplane.node_session import NodeSession
from controlplane.nodes import NodeSessions
from controlplane.scheduler.snapshot import SCHEDULING, IncrementalState, decode_state, graph_snapshot
from controlplane.settings import ReplicaSettings
from controlplane.store import KV, EtcdStore, PutOp, WatchEvent
from kunlun_common.api import agent_pb2, types_pb2, workload_pb2

DEVICES = 8


def devices(node: str) -> list[types_pb2.Device]:
    return [
        types_pb2.Device(
            name=f"{node}/ascend:{i}",
            node=node,
            device_type="ascend",
            index=i,
            model="910B",
            hbm_memory_mb=32768,
            status=types_pb2.DEVICE_STATUS_READY,
        )
        for i in range(DEVICES)
    ]


def node_value(node: str, status: int = types_pb2.DEVICE_STATUS_READY) -> bytes:
    rec = types_pb2.Node(name=node, address="127.0.0.1", devices=devices(node), ready=True)
    for d in rec.devices:
        d.status = status  # type: ignore[assignment]
    return keys.encode_message(rec)


def telemetry_value(node: str, util: float) -> bytes:
    return keys.encode(
        {"at_ms": 1, "devices": {f"{node}/ascend:{i}": {"utilization_pct": util} for i in range(DEVICES)}}
    )


def name(i: int) -> str:
    return f"n{i:05d}"


class Replica:
    """A replica's change handling fed by synthetic watch events: feeds, one assignment stream per
    node, and the leader's decoded state and wake-up topic (as `SchedulerLoop.run` uses them)."""

    def __init__(self, nodes: int) -> None:
        self.feeds = Feeds(None)
        self.cache = self.feeds.cache
        self.rev = 0
        kvs = []
        wl = workload_pb2.Workload(id="w1", spec=workload_pb2.WorkloadSpec(name="chat", replicas=nodes))
        kvs.append(self._kv(keys.workload("w1"), keys.encode_message(wl)))
        for i in range(nodes):
            n = name(i)
            kvs.append(self._kv(keys.node(n), node_value(n)))
            kvs.append(self._kv(keys.alive(n), keys.encode({"replica": "r1", "lease": 1})))
            kvs.append(self._kv(keys.telemetry(n), telemetry_value(n, 1.0)))
            inst = workload_pb2.Instance(
                id=f"w1-{i}",
                workload_id="w1",
                ordinal=i,
                node=n,
                phase="Running",
                target_devices=[f"{n}/ascend:0"],
            )
            kvs.append(self._kv(keys.instance(inst.id), keys.encode_message(inst)))
            kvs.append(self._kv(keys.alloc(f"{n}/ascend:0"), keys.encode({"instance": inst.id})))
        self.cache.load(kvs, self.rev)
        self.state = self.cache.derived(IncrementalState)
        self.scheduler_wake = self.cache.topic(SCHEDULING)
        settings = ReplicaSettings(
            name="r1", cert_dir="/nonexistent", etcd_endpoints=("https://127.0.0.1:1",)
        )
        self.sessions = NodeSessions(None, settings)  # type: ignore[arg-type]  # no etcd write expected
        self.api = AgentService(self.sessions, self.feeds, "r1", 10)
        self.queues: dict[str, asyncio.Queue[agent_pb2.ReplicaMessage | None]] = {}
        self.tasks: list[asyncio.Task[None]] = []
        for i in range(nodes):
            self.connect(name(i))

    def _kv(self, key: str, value: bytes) -> KV:
        self.rev += 1
        return KV(key, value, self.rev, self.rev, 1, 0)

    def put(self, key: str, value: bytes) -> None:
        self.cache.apply(WatchEvent("put", self._kv(key, value)))

    def connect(self, node: str) -> None:
        session = NodeSession(
            node=node, record=types_pb2.Node(name=node, devices=devices(node)), lease=1, connected_at=0
        )
        q: asyncio.Queue[agent_pb2.ReplicaMessage | None] = asyncio.Queue()
        self.queues[node] = q
        self.tasks.append(asyncio.create_task(self.api._push_assignments(session, q), name=f"push-{node}"))

    async def settle(self) -> None:
        """Let every woken task run (yields to the loop; no waiting on time)."""
        for _ in range(10):
            await asyncio.sleep(0)

    def sent(self) -> dict[str, int]:
        return {n: q.qsize() for n, q in self.queues.items() if q.qsize()}

    def drain(self) -> None:
        for q in self.queues.values():
            while not q.empty():
                q.get_nowait()

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def cost(self, change: str) -> dict[str, int]:
        """Counter deltas (and scheduler wake-ups) caused by one change."""
        await self.settle()
        self.drain()
        self.state.current()  # the leader's tick reads the state
        before = self.cache.work.snapshot()
        woke = self.scheduler_wake.version
        calls = 0

        def count(frame: object, event: str, arg: object) -> None:
            nonlocal calls
            if event in ("call", "c_call"):
                calls += 1

        sys.setprofile(count)  # every Python and builtin call the change causes, in every task
        try:
            await self._change(change)
            await self.settle()
        finally:
            sys.setprofile(None)
        st = self.state.current()
        assert st.revision == self.cache.revision
        after = self.cache.work.snapshot()
        delta = {k: after[k] - before[k] for k in after}
        delta["function calls"] = calls
        delta["scheduler wakeups"] = self.scheduler_wake.version - woke
        delta["streams sent to"] = len(self.sent())
        return delta

    async def _change(self, change: str) -> None:
        n = name(7)
        if change == "telemetry":
            self.put(keys.telemetry(n), telemetry_value(n, 50.0))
        elif change == "alive":
            self.put(keys.alive(n), keys.encode({"replica": "r2", "lease": 2}))
        elif change == "device status":
            self.put(keys.node(n), node_value(n, types_pb2.DEVICE_STATUS_UNHEALTHY))
        elif change == "registration":
            new = f"new-{len(self.queues)}"
            self.put(keys.node(new), node_value(new))
            self.put(keys.alive(new), keys.encode({"replica": "r1", "lease": 3}))
            self.connect(new)
        elif change == "placement":
            inst = workload_pb2.Instance(
                id="w1-x",
                workload_id="w1",
                ordinal=99999,
                node=n,
                phase="Scheduled",
                target_devices=[f"{n}/ascend:1"],
            )
            self.put(keys.instance(inst.id), keys.encode_message(inst))


CHANGES = ("telemetry", "alive", "device status", "registration", "placement")


async def test_change_costs_the_same_at_100_and_1000_nodes() -> None:
    costs: dict[int, dict[str, dict[str, int]]] = {}
    for nodes in (100, 1000):
        r = Replica(nodes)
        try:
            await r.settle()
            assert len(r.sent()) == nodes  # every stream got its first assignment set
            costs[nodes] = {change: await r.cost(change) for change in CHANGES}
        finally:
            await r.close()
    for change in CHANGES:
        small, big = dict(costs[100][change]), dict(costs[1000][change])
        # the counted work is equal; the raw call count may differ by a few calls of event-loop
        # scheduling between runs, but must not grow with the cluster (10x the nodes)
        calls_small, calls_big = small.pop("function calls"), big.pop("function calls")
        assert small == big, f"{change}: {costs[100][change]} at 100 nodes, {costs[1000][change]} at 1000"
        assert calls_big <= calls_small * 1.1 + 10, (
            f"{change}: {calls_small} calls at 100 nodes, {calls_big} at 1000"
        )


async def test_what_each_change_reaches() -> None:
    """The routing itself: which consumers a change reaches, counted exactly."""
    big = Replica(200)
    try:
        await big.settle()
        tele = await big.cost("telemetry")
        assert tele["decodes"] == 0 and tele["wakeups"] == 0 and tele["sends"] == 0 and tele["computes"] == 0
        assert tele["scheduler wakeups"] == 0  # telemetry does not wake the scheduler
        assert big.state.current().telemetry[name(7)]["devices"]  # ... but its state has the new sample
        alive = await big.cost("alive")
        assert alive["decodes"] == 0 and alive["sends"] == 0 and alive["scheduler wakeups"] == 1
        status = await big.cost("device status")
        assert status["decodes"] == 1 and status["sends"] == 0 and status["scheduler wakeups"] == 1
        reg = await big.cost("registration")
        assert reg["decodes"] == 1 and reg["sends"] == 1 and reg["computes"] == 1  # the new node's first set
        placed = await big.cost("placement")
        assert placed["sends"] == 1 and placed["streams sent to"] == 1 and placed["computes"] == 1
        msg = big.queues[name(7)].get_nowait()
        assert msg is not None and {a.instance_id for a in msg.assignments.items} == {"w1-7", "w1-x"}
    finally:
        await big.close()


async def test_workload_change_reaches_only_its_nodes() -> None:
    r = Replica(50)
    try:
        await r.settle()
        r.drain()
        wl = workload_pb2.Workload(id="w2", spec=workload_pb2.WorkloadSpec(name="other", replicas=1))
        r.put(keys.workload("w2"), keys.encode_message(wl))
        inst = workload_pb2.Instance(
            id="w2-0", workload_id="w2", node=name(3), phase="Running", target_devices=["x"]
        )
        r.put(keys.instance(inst.id), keys.encode_message(inst))
        await r.settle()
        assert r.sent() == {name(3): 1}
        r.drain()
        wl.deleting = True
        r.put(keys.workload("w2"), keys.encode_message(wl))
        await r.settle()
        assert r.sent() == {name(3): 1}  # only the node running w2 hears of its deletion
        msg = r.queues[name(3)].get_nowait()
        assert msg is not None and [a.instance_id for a in msg.assignments.items] == ["w1-3"]
    finally:
        await r.close()


async def test_heartbeat_costs_one_ack_and_no_change() -> None:
    """A heartbeat that changes nothing writes nothing and reaches nothing but its own ack."""
    for nodes in (100, 1000):
        r = Replica(nodes)
        try:
            await r.settle()
            n = name(5)
            session = NodeSession(
                node=n, record=types_pb2.Node(name=n, devices=devices(n)), lease=1, connected_at=0
            )
            session.snapshot_at = time.monotonic()
            r.sessions.lease, r.sessions.lease_ok_at = 1, time.monotonic()  # the replica's liveness lease
            sample = types_pb2.DeviceTelemetry(utilization_pct=1.0)
            session.snapshot_written = {d.name: sample for d in session.record.devices}
            hb = agent_pb2.Heartbeat(
                seq=1,
                samples=[
                    agent_pb2.DeviceSample(name=d.name, telemetry=sample) for d in session.record.devices
                ],
            )

            async def one(hb: agent_pb2.Heartbeat = hb) -> AsyncIterator[agent_pb2.AgentMessage]:
                yield agent_pb2.AgentMessage(heartbeat=hb)

            before = r.cache.work.snapshot()
            out: asyncio.Queue[agent_pb2.ReplicaMessage | None] = asyncio.Queue()
            await r.api._read(one(), session, out)
            assert r.cache.work.snapshot() == before
            ack = out.get_nowait()
            assert ack is not None and ack.heartbeat_ack.seq == 1
            assert out.get_nowait() is None  # end of the stream
        finally:
            await r.close()


async def _etcd_costs(store: EtcdStore, nodes: int) -> dict[str, dict[str, int]]:
    """Registration and heartbeats through `NodeSessions` against real etcd, seen by a replica's
    feeds (with a stream per node) and the leader's state, at a cluster of `nodes` nodes."""
    await store.delete(keys.ROOT, prefix=True)
    puts = []
    for i in range(nodes):
        n = name(i)
        puts += [
            PutOp(keys.node(n), node_value(n)),
            PutOp(keys.alive(n), keys.encode({"replica": "r1", "lease": 0})),
            PutOp(keys.telemetry(n), telemetry_value(n, 1.0)),
        ]
    for at in range(0, len(puts), 120):
        assert (await store.txn([], puts[at : at + 120])).succeeded
    feeds = Feeds(store)
    await feeds.start()
    cache = feeds.cache
    state = cache.derived(IncrementalState)
    wake = cache.topic(SCHEDULING)
    settings = ReplicaSettings(name="r1", cert_dir="/nonexistent", etcd_endpoints=("https://127.0.0.1:1",))
    sessions = NodeSessions(store, settings)
    api = AgentService(sessions, feeds, "r1", 10)
    queues: dict[str, asyncio.Queue[agent_pb2.ReplicaMessage | None]] = {}
    tasks = []
    for i in range(nodes):
        n = name(i)
        queues[n] = asyncio.Queue()
        s = NodeSession(node=n, record=types_pb2.Node(name=n), lease=0, connected_at=0)
        tasks.append(asyncio.create_task(api._push_assignments(s, queues[n])))
    costs: dict[str, dict[str, int]] = {}
    session: NodeSession | None = None

    async def measure(what: str, act: Callable[[], Awaitable[object]]) -> None:
        for _ in range(10):
            await asyncio.sleep(0)
        for q in queues.values():
            while not q.empty():
                q.get_nowait()
        before, woke = cache.work.snapshot(), wake.version
        await act()
        assert await cache.wait_for_revision(await store.revision(), 30)
        for _ in range(10):
            await asyncio.sleep(0)
        state.current()
        after = cache.work.snapshot()
        costs[what] = {k: after[k] - before[k] for k in after}
        costs[what]["scheduler wakeups"] = wake.version - woke
        costs[what]["streams sent to"] = sum(1 for q in queues.values() if q.qsize())

    async def register() -> None:
        nonlocal session
        reg = agent_pb2.RegisterNode(node="probe", address="127.0.0.1", devices=devices("probe"))
        session = await sessions.register(reg, "agent:probe")

    def beat(status: types_pb2.DeviceStatus.ValueType) -> Callable[[], Awaitable[object]]:
        async def go() -> None:
            assert session is not None
            session.snapshot_at = 0.0  # a telemetry snapshot is due
            samples = [
                agent_pb2.DeviceSample(
                    name=d.name, status=status, telemetry=types_pb2.DeviceTelemetry(utilization_pct=3.0)
                )
                for d in session.record.devices
            ]
            assert await sessions.heartbeat(session, agent_pb2.Heartbeat(seq=1, samples=samples))
            await sessions.flush(session)  # the state write runs beside the stream

        return go

    try:
        await measure("registration", register)
        await measure("heartbeat", beat(types_pb2.DEVICE_STATUS_READY))
        await measure("heartbeat with a device status change", beat(types_pb2.DEVICE_STATUS_UNHEALTHY))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if session is not None:
            await sessions.disconnect(session)
            await store.lease_revoke(session.lease)
        await feeds.stop()
        await store.delete(keys.ROOT, prefix=True)
    return costs


async def test_real_etcd_registration_and_heartbeats_cost_the_same(store: EtcdStore) -> None:
    small = await _etcd_costs(store, 100)
    big = await _etcd_costs(store, 1000)
    assert small == big, f"100 nodes: {small}\n1000 nodes: {big}"
    assert big["heartbeat"]["events"] == 1 and big["heartbeat"]["decodes"] == 0  # one telemetry write
    assert big["heartbeat"]["scheduler wakeups"] == 0 and big["heartbeat"]["streams sent to"] == 0
    assert big["registration"]["events"] == 2 and big["registration"]["decodes"] == 1  # node + alive
    changed = big["heartbeat with a device status change"]
    assert changed["decodes"] == 1 and changed["scheduler wakeups"] == 1 and changed["streams sent to"] == 0


async def test_scheduler_views_are_rebuilt_only_for_changed_nodes() -> None:
    r = Replica(100)
    try:
        first = graph_snapshot(r.state.current())
        n = name(7)
        r.put(keys.telemetry(n), telemetry_value(n, 50.0))
        r.put(keys.alloc(f"{name(9)}/ascend:3"), keys.encode({"instance": "w1-9"}))
        second = graph_snapshot(r.state.current())
        changed = {a.name for a, b in zip(first.nodes, second.nodes, strict=True) if a is not b}
        assert changed == {name(7), name(9)}
        by_name = {v.name: v for v in second.nodes}
        assert {d.utilization_pct for d in by_name[n].devices} == {50.0}
        assert by_name[name(9)].devices[3].allocated_to == "w1-9"
        assert by_name[name(9)].devices[0].allocated_to == "w1-9"  # from the initial state
        assert by_name[name(9)].devices[1].allocated_to is None
        assert graph_snapshot(decode_state(r.cache.kvs, r.cache.revision)) == second  # same as a full decode
    finally:
        await r.close()


async def test_resync_rebuilds_indexes_and_revision_waiters_wake() -> None:
    """After a compaction the cache is re-listed: indexes rebuilt, streams told, waiters woken."""
    r = Replica(20)
    try:
        await r.settle()
        r.drain()
        target = r.cache.revision + 5
        waiter = asyncio.create_task(r.cache.wait_for_revision(target, 30))
        kvs = [kv for kv in r.cache.kvs.values() if kv.key != keys.instance("w1-3")]
        r.cache.load(kvs, target)  # a Resync: w1-3 is gone
        assert await waiter
        await r.settle()
        assert r.sent() == {name(3): 1}  # only node 3's set changed
        msg = r.queues[name(3)].get_nowait()
        assert msg is not None and list(msg.assignments.items) == []
        assert "w1-3" not in r.state.current().instances
        assert not await r.cache.wait_for_revision(target + 1, 0.05)  # not there yet: False, no hang
    finally:
        await r.close()
