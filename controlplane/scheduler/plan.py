"""`schedule()`: the pure function from (snapshot, pending, running, config, now) to a `Plan`.

Pending instances are served in weighted-fair order (see `queue`) and placed greedily: each takes
the best candidate (see `scores` for the key) and its devices leave the plan's free set. An instance
of a class in `preemption_enabled_for` that fits nowhere may evict the fewest running instances of
lower priority. Instances that still fit nowhere are reported with a reason per node.

The leader commits the plan in fenced transactions (at most `max_placements_per_commit` placements
each) and calls `schedule()` again on a fresh snapshot when a commit is rejected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import combinations
from types import MappingProxyType

from controlplane.scheduler.config import SchedulerConfig
from controlplane.scheduler.filters import (
    DEVICE_FILTERS,
    GROUP_FILTERS,
    NO_FREE_DEVICE,
    Depends,
    Filter,
    insufficient_devices,
)
from controlplane.scheduler.index import Candidate, ClusterIndex, Key, LazyPool, NodeEntry, Slot, new_tuple
from controlplane.scheduler.model import (
    PRIORITY_RANK,
    GraphSnapshot,
    PendingInstance,
    Placement,
    Plan,
    RunningInstance,
    Unplaced,
    WorkloadReq,
)
from controlplane.scheduler.queue import order_pending
from controlplane.scheduler.requirement import Requirement, RequirementInputs, requirement_key
from controlplane.scheduler.scores import distance, profile_part, set_distance

MAX_VICTIMS_PER_NODE = 8
"""Preemption considers at most this many (most evictable) running instances per node, so at most
255 victim sets per node."""


class WorkloadClass:
    """Per-requirement state shared by identical pending instances within one plan."""

    def __init__(self, index: ClusterIndex, req: Requirement) -> None:
        self.req = req
        self.index = index
        config = index.config
        # the device filters that apply to this requirement, with their stage (position in the table)
        self.stages: list[tuple[int, Filter]] = [
            (pos, f) for pos, f in enumerate(DEVICE_FILTERS) if f.applies(req)
        ]
        self.groups = [f for f in GROUP_FILTERS if f.applies(req)]
        # per profile: the first failing profile filter (stage, reason), else None; its compute score
        self.profile_failure: list[tuple[int, str] | None] = []
        self.compute: list[float] = []
        for profile in index.profiles:
            dev = profile.sample
            failure: tuple[int, str] | None = None
            for pos, f in self.stages:
                if f.depends is Depends.PROFILE and (reason := f.check(dev, req)) is not None:
                    failure = (pos, reason)
                    break
            self.profile_failure.append(failure)
            self.compute.append(profile_part(dev, req, index.best_tflops))
        # one device from any node's best per profile, when only profile and condition filters apply
        self.single = (
            req.devices == 1
            and not self.groups
            and all(f.depends is not Depends.DEVICE for _, f in self.stages)
        )
        self._single_profiles = [
            (index.profile_pool(p), req.rank_of(p.sample.device_type), self.compute[p.pid])
            for p in index.profiles
            if self.single and self.profile_failure[p.pid] is None
        ]
        self._config = config
        self._analyzed = False
        self._pool: LazyPool[Key, tuple[Slot, ...]] | None = None
        self.preemption_pools: dict[int, LazyPool[PreemptKey, Preemption]] = {}
        # Filled by analyze():
        self.static_reason: list[str | None] = []
        self.eligible: dict[int, dict[str, list[Slot]]] = {}
        self.reasons: Mapping[str, str] = MappingProxyType({})
        self._eligible_slots: frozenset[Slot] | None = None

    def best(self) -> tuple[Key, tuple[Slot, ...]] | None:
        """The best free candidate (key, devices) in the whole graph, or None."""
        if not self.single:
            if self._pool is None:
                self.analyze()
                self._pool = LazyPool(self.index, list(self.eligible), self.evaluate)
            return self._pool.top()
        best: tuple[tuple[int, int, int, float, str, tuple[int, ...]], tuple[Slot, ...]] | None = None
        for pool, rank, compute in self._single_profiles:
            found = pool.top()
            if found is not None:
                (busy, _, dist, neg_score, name, positions), slots = found
                key = (busy, rank, dist, neg_score - compute, name, positions)  # plain: the hot path
                if best is None or key < best[0]:
                    best = key, slots
        return None if best is None else (new_tuple(Key, best[0]), best[1])  # a plain pair: once per decision

    def evaluate(self, idx: int, extra: frozenset[Slot] = frozenset()) -> Candidate | None:
        """Best device set on node `idx` from its free eligible devices plus `extra` (victims')."""
        entry = self.index.nodes[idx]
        best: Candidate | None = None
        for device_type, slots in self.eligible[idx].items():
            avail = [s for s in slots if s.free or s in extra]
            if len(avail) < self.req.devices:
                continue
            found = self._best_set(entry, avail, self.req.rank_of(device_type))
            if best is None or found.key < best.key:
                best = found
        return best

    def _best_set(self, entry: NodeEntry, avail: list[Slot], rank: int) -> Candidate:
        """The best `n` of `avail`: least busy, then the smallest total distance, then the best score."""
        n = self.req.devices
        base = self.index.node_score(entry)
        compute = self.compute
        if n == 1:
            slot = min(avail, key=lambda s: (s.busy, -(s.score + compute[s.profile.pid]), s.pos))
            score = base + slot.score + compute[slot.profile.pid]
            one = new_tuple(Key, (slot.busy, rank, 0, -score, entry.name, (slot.pos,)))
            return new_tuple(Candidate, (one, (slot,)))
        by_pos = {s.pos: s for s in avail}
        table = self.index.subsets(entry, n)
        if table is None:
            table = sorted(
                (set_distance(entry.rows, p), p)
                for p in {tuple(sorted(self._grow(entry, avail, s))) for s in avail}
            )
        best: tuple[tuple[int, int, int, float, str, tuple[int, ...]], tuple[Slot, ...]] | None = None
        for dist, positions in table:
            if best is not None and best[0][0] == 0 and dist > best[0][2]:
                break  # sorted by distance: nothing further can beat an idle set
            subset = [by_pos.get(p) for p in positions]
            if None in subset:
                continue
            slots = tuple(s for s in subset if s is not None)
            busy = max(s.busy for s in slots)
            score = base + sum(s.score + compute[s.profile.pid] for s in slots) / n
            key = (busy, rank, dist, -score, entry.name, positions)  # a plain tuple in this hot loop
            if best is None or key < best[0]:
                best = key, slots
        assert best is not None, "avail holds at least n devices"
        return new_tuple(Candidate, (new_tuple(Key, best[0]), best[1]))

    def _grow(self, entry: NodeEntry, avail: list[Slot], seed: Slot) -> list[int]:
        """Positions of a set grown from `seed` by adding the device closest to the set each time."""
        chosen = [seed.pos]
        rest = [s for s in avail if s is not seed]
        while len(chosen) < self.req.devices:
            nxt = min(
                rest,
                key=lambda s: (sum(distance(entry.rows, c, s.pos) for c in chosen), s.busy, -s.score, s.pos),
            )
            chosen.append(nxt.pos)
            rest.remove(nxt)
        return chosen

    def eligible_slots(self) -> frozenset[Slot]:
        """Every device that passes the static filters for this requirement (after `analyze`)."""
        if self._eligible_slots is None:
            self._eligible_slots = frozenset(
                s for by_type in self.eligible.values() for slots in by_type.values() for s in slots
            )
        return self._eligible_slots

    def analyze(self) -> None:
        """Static per-node filtering: eligible devices per type, else the reason of the node."""
        if self._analyzed:
            return
        self._analyzed = True
        reasons: dict[str, str] = {}
        for entry in self.index.nodes:
            reason = entry.reason if entry.reason is not None else self._node_reason(entry)
            self.static_reason.append(reason)
            reasons[entry.name] = NO_FREE_DEVICE if reason is None else reason
        self.reasons = MappingProxyType(reasons)

    def _node_reason(self, entry: NodeEntry) -> str | None:
        """None when the node has enough eligible devices (recorded in `eligible`), else why not.

        Each device group (same profile, same failing condition filter) runs the device filters in
        table order; the node quotes the reason of the group that got furthest, and among equals the
        one whose device ranks highest for that filter (e.g. the largest memory, the coolest device).
        Then the group filters run on the devices that passed, per device type.
        """
        req = self.req
        config = self._config
        furthest: tuple[int, float] = (-1, 0.0)
        text = ""
        passing: dict[str, list[Slot]] = {}
        for group in entry.groups:
            slots = group.slots
            failure = self.profile_failure[group.profile.pid]
            stopped: tuple[int, float, str] | None = None
            for pos, f in self.stages:
                if f.depends is Depends.PROFILE:
                    if failure is not None and failure[0] == pos:
                        rank = f.rank(group.profile.sample) if f.rank else 0.0
                        stopped = (pos, rank, failure[1])
                        break
                elif f.depends is Depends.DEVICE:
                    matching = tuple(s for s in slots if f.check(s.device, req) is None)
                    if not matching:
                        stopped = (pos, 0.0, f.check(slots[0].device, req) or f.reason)
                        break
                    slots = matching
                elif group.failed == pos:
                    ranked = f.rank
                    top = max(slots, key=lambda s: ranked(s.device)) if ranked else slots[0]
                    stopped = (
                        pos,
                        ranked(top.device) if ranked else 0.0,
                        f.check(top.device, config) or f.reason,
                    )
                    break
            if stopped is None:
                passing.setdefault(group.profile.sample.device_type, []).extend(slots)
            elif stopped[:2] > furthest:
                furthest, text = stopped[:2], stopped[2]
        n = req.devices
        if passing:
            usable = passing
            blocked = ""
            for f in self.groups:
                kept = {t: [s for s in v if f.check(s.device, req) is None] for t, v in usable.items()}
                if max(len(v) for v in usable.values()) >= n > max(len(v) for v in kept.values()):
                    dropped = next(s for t, v in usable.items() for s in v if s not in kept[t])
                    blocked = f.check(dropped.device, req) or f.reason
                usable = kept
            if max(len(v) for v in usable.values()) >= n:
                self.eligible[entry.idx] = {t: sorted(v, key=_pos) for t, v in usable.items() if len(v) >= n}
                return None
            most = max(len(v) for v in passing.values())
            return blocked or insufficient_devices(n, most)
        return text or insufficient_devices(n, 0)


def _pos(slot: Slot) -> int:
    return slot.pos


VictimCost = tuple[int, float, str]
"""(-priority rank, -started_at, id): smaller is evicted first (lowest priority, then newest)."""
PreemptKey = tuple[int, tuple[VictimCost, ...], Key]
"""(number of victims, their costs, most costly first, placement key): smaller is better."""
Preemption = tuple[Candidate, tuple[RunningInstance, ...]]
"""Where the instance would go and whom it evicts."""


def _victim_cost(run: RunningInstance) -> VictimCost:
    return (-PRIORITY_RANK[run.workload.priority], -run.started_at, run.instance_id)


class PlanBuilder:
    """Decides pending instances one at a time against one snapshot (the body of `schedule()`)."""

    def __init__(
        self, snapshot: GraphSnapshot, running: Sequence[RunningInstance], config: SchedulerConfig
    ) -> None:
        self.index = ClusterIndex(snapshot, config)
        self.config = config
        self._classes: dict[tuple[object, ...], WorkloadClass] = {}
        self._by_workload: dict[int, tuple[WorkloadReq, WorkloadClass]] = {}
        self._preemptors = frozenset(PRIORITY_RANK[p] for p in config.preemption_enabled_for)
        self._evicted: set[str] = set()
        # Per node, running instances in eviction order with their devices on that node.
        by_node: dict[int, list[tuple[VictimCost, RunningInstance, tuple[Slot, ...]]]] = {}
        for run in running:
            if run.workload.priority not in PRIORITY_RANK:
                continue  # an unknown priority is never evicted
            slots: dict[int, list[Slot]] = {}
            for name in run.devices:
                slot = self.index.slots_by_name.get(name)
                if slot is not None:
                    slots.setdefault(slot.node_idx, []).append(slot)
            for idx, held in slots.items():
                by_node.setdefault(idx, []).append((_victim_cost(run), run, tuple(held)))
        for victims in by_node.values():
            victims.sort(key=lambda v: v[0])
        self._running_by_node = by_node

    def workload_class(self, inst: PendingInstance) -> WorkloadClass:
        """The shared per-requirement state for `inst`."""
        workload = inst.workload
        seen = self._by_workload.get(id(workload))  # instances of one workload share its record
        if seen is not None and seen[0] is workload:
            return seen[1]
        key = requirement_key(workload)
        cls = self._classes.get(key)
        if cls is None:
            cls = WorkloadClass(self.index, Requirement.from_inputs(RequirementInputs._make(key)))
            self._classes[key] = cls
        self._by_workload[id(workload)] = (workload, cls)  # holds the record: its id stays its own
        return cls

    def decide(self, inst: PendingInstance) -> Placement | Unplaced:
        """Place `inst` (taking its devices from the plan's free set) or say why not."""
        cls = self.workload_class(inst)
        found = cls.best()
        if found is not None:
            return self._take(inst, found, ())
        rank = PRIORITY_RANK.get(inst.workload.priority)
        if rank is not None and rank in self._preemptors:
            pool = cls.preemption_pools.get(rank)
            if pool is None:
                cls.analyze()
                nodes = [i for i in self._running_by_node if cls.static_reason[i] is None]
                pool = LazyPool(self.index, sorted(nodes), lambda idx: self._preemption_on(cls, rank, idx))
                cls.preemption_pools[rank] = pool
            option = pool.top()
            if option is not None:
                candidate, victims = option[1]
                return self._take(inst, Candidate(*candidate), victims)
        cls.analyze()
        return Unplaced(inst.instance_id, cls.reasons)

    def _take(
        self, inst: PendingInstance, found: tuple[Key, tuple[Slot, ...]], victims: Sequence[RunningInstance]
    ) -> Placement:
        key, slots = found
        index = self.index
        touched = set()
        for slot in slots:
            index.take(slot)
            touched.add(slot.node_idx)
        for run in victims:
            self._evicted.add(run.instance_id)
            for name in run.devices:
                freed = index.slots_by_name.get(name)
                if freed is not None and not freed.taken:
                    index.take(freed)  # reserved: freed by the eviction, reused by a later plan
                    touched.add(freed.node_idx)
        index.refresh(sorted(touched))
        return Placement(
            instance_id=inst.instance_id,
            node=index.nodes[slots[0].node_idx].name,
            devices=tuple(s.device.name for s in slots),
            score=round(-key.neg_score, 6),
            preempts=tuple(run.instance_id for run in victims),
        )

    def _preemption_on(self, cls: WorkloadClass, rank: int, idx: int) -> tuple[PreemptKey, Preemption] | None:
        """The best way to fit `cls` on node `idx` by evicting the fewest lower-priority instances.

        Among sets of equal size: the one whose most costly victim is cheapest (lowest priority, then
        newest), then the best placement. Sets too small to free enough devices are skipped unevaluated.
        """
        eligible = cls.eligible_slots()
        victims: list[tuple[VictimCost, RunningInstance, frozenset[Slot]]] = []
        for cost, run, held in self._running_by_node[idx]:
            if -cost[0] <= rank or run.instance_id in self._evicted:
                continue
            freed = frozenset(s for s in held if s in eligible and not s.taken)
            if freed:
                victims.append((cost, run, freed))
                if len(victims) == MAX_VICTIMS_PER_NODE:
                    break
        need = cls.req.devices - self.index.nodes[idx].free_count
        sizes = sorted((len(v[2]) for v in victims), reverse=True)
        fewest = 1  # no set smaller than this can free enough devices
        while fewest <= len(sizes) and sum(sizes[:fewest]) < need:
            fewest += 1
        for k in range(fewest, len(victims) + 1):
            best: tuple[PreemptKey, Preemption] | None = None
            for combo in combinations(victims, k):
                costs = tuple(sorted((v[0] for v in combo), reverse=True))
                if (best is not None and costs > best[0][1]) or sum(len(v[2]) for v in combo) < need:
                    continue
                found = cls.evaluate(idx, frozenset().union(*(v[2] for v in combo)))
                if found is not None and (best is None or (k, costs, found[0]) < best[0]):
                    best = (k, costs, found[0]), (found, tuple(v[1] for v in combo))
            if best is not None:
                return best
        return None


def schedule(
    snapshot: GraphSnapshot,
    pending: Sequence[PendingInstance],
    running: Sequence[RunningInstance],
    config: SchedulerConfig,
    now: float,
    max_placements: int | None = None,
) -> Plan:
    """Place as much of `pending` as fits, in weighted-fair order; a pure function of its arguments.

    `max_placements` stops after that many placements (instances after the stop are in neither
    `placements` nor `unplaced`); None decides the whole queue. Raises ValueError for duplicate
    pending ids or a priority without a positive weight.
    """
    if max_placements is not None and max_placements < 0:
        raise ValueError(f"max_placements must be >= 0, got {max_placements}")
    ids = {p.instance_id for p in pending}
    if len(ids) != len(pending):
        raise ValueError("duplicate instance_id in pending")
    ordered = order_pending(pending, config.priority_weights)
    builder = PlanBuilder(snapshot, running, config)
    placements: list[Placement] = []
    unplaced: list[Unplaced] = []
    for inst in ordered:
        if max_placements is not None and len(placements) >= max_placements:
            break
        outcome = builder.decide(inst)
        if isinstance(outcome, Placement):
            placements.append(outcome)
        else:
            unplaced.append(outcome)
    return Plan(tuple(placements), tuple(unplaced), decided_at=now, graph_revision=snapshot.revision)
