"""Indexes built once per `schedule()` call so that one decision does not scan the whole graph.

- every device becomes a `Slot` (its static score and flags computed once);
- identical devices share a `Profile` (type, model, memory, precisions, throughput, p2p), so the
  profile filters and scores run once per profile, not once per device;
- the node filters run once per node and the condition filters once per device (`filters.FILTERS`);
- each node keeps its free count, a version bumped whenever one of its devices is taken, and its
  devices grouped by (profile, failing condition filter) for reason reporting;
- a `LazyPool` keeps the best candidate of each node in a heap. Taking a device re-evaluates only
  that node in the pools that contain it; entries of an older node version are dropped when they
  reach the top. A decision costs O(log nodes) instead of O(devices).

Slots and pools are mutable but private to one `schedule()` call.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import combinations
from math import comb
from typing import Any, Generic, NamedTuple, TypeVar

from controlplane.scheduler.config import SchedulerConfig
from controlplane.scheduler.filters import condition_failures, filter_node
from controlplane.scheduler.model import DeviceView, GraphSnapshot, NodeView
from controlplane.scheduler.scores import device_parts, is_busy, node_part, set_distance, tflops


class Key(NamedTuple):
    """How good a candidate is; smaller is better (compared field by field, see `scores`)."""

    busy: int
    """1 when a device of the set is above the utilization threshold."""
    type_rank: int
    """Rank of the device type among the preferred types (0 is the most preferred)."""
    distance: int
    """Total pairwise topology distance of the set."""
    neg_score: float
    """Minus the weighted score (so that a higher score sorts first)."""
    node: str
    """Node name: equal candidates resolve the same way every time."""
    positions: tuple[int, ...]
    """Device positions on the node."""


class Candidate(NamedTuple):
    """A key and the slots it would take."""

    key: Key
    slots: tuple[Slot, ...]


RawKey = tuple[int, int, int, float, str, tuple[int, ...]]
"""The fields of a `Key` in a plain tuple: the profile pools' keys (refreshed on every take, and a
plain tuple costs far less to build and free than a named one)."""

new_tuple = tuple.__new__
"""`new_tuple(Key, (...))` builds a Key (or a Candidate) without the Python-level `__new__` of
NamedTuple: one builtin call, for the paths that run on every decision."""


METRICS = ("fp16", "bf16", "int8")
MAX_SUBSETS = 1024
"""Above this many device subsets of one node, multi-device sets are grown greedily from each device."""
K = TypeVar("K", bound=tuple[Any, ...])
V = TypeVar("V")


@dataclass(frozen=True)
class Profile:
    """Capabilities shared by identical devices."""

    pid: int
    """Position in `ClusterIndex.profiles`."""
    sample: DeviceView
    """One device of the profile (for type, memory, precisions and throughput)."""


class Slot:
    """One device plus the plan-local state `taken`."""

    __slots__ = ("allocated", "busy", "device", "node_idx", "pos", "profile", "schedulable", "score", "taken")

    def __init__(
        self,
        device: DeviceView,
        node_idx: int,
        pos: int,
        profile: Profile,
        schedulable: bool,
        busy_above: float,
        score: float,
    ) -> None:
        self.device = device
        self.node_idx = node_idx
        self.pos = pos
        self.profile = profile
        self.schedulable = schedulable
        self.busy = int(is_busy(device.utilization_pct, busy_above))
        self.score = score
        self.allocated = device.allocated_to is not None
        self.taken = False

    @property
    def free(self) -> bool:
        """Not held by a running instance and not used earlier in this plan."""
        return not self.allocated and not self.taken


@dataclass(frozen=True)
class Group:
    """Devices of one node with the same profile that fail the same condition filter (or none)."""

    profile: Profile
    """Their profile."""
    failed: int | None
    """Stage (position in `filters.DEVICE_FILTERS`) of the condition filter they fail, or None."""
    slots: tuple[Slot, ...]
    """The devices, in node order."""


class NodeEntry:
    """A node's static view and plan-local counters."""

    __slots__ = (
        "free_count", "groups", "idx", "name", "node", "pools", "reason", "rows", "rows_id", "slots", "version"
    )  # fmt: skip

    def __init__(self, node: NodeView, idx: int, config: SchedulerConfig) -> None:
        self.node = node
        self.name = node.name
        self.idx = idx
        self.reason = filter_node(node, config)
        self.slots: list[Slot] = []
        self.rows = tuple(d.topology_distance for d in node.devices)
        self.rows_id = 0
        self.groups: list[Group] = []
        self.free_count = 0
        self.version = 0
        self.pools: list[LazyPool[Any, Any]] = []


class ClusterIndex:
    """Slots, profiles, groups and pools of one snapshot under one config."""

    def __init__(self, snapshot: GraphSnapshot, config: SchedulerConfig) -> None:
        self.config = config
        self.nodes: list[NodeEntry] = []
        self.slots_by_name: dict[str, Slot] = {}
        self.profiles: list[Profile] = []
        profile_ids: dict[tuple[object, ...], Profile] = {}
        rows_ids: dict[tuple[tuple[int, ...], ...], int] = {}
        best = dict.fromkeys(METRICS, 0.0)
        schedulable: dict[int, dict[int, list[Slot]]] = {}
        busy_above = config.min_gpu_utilization_threshold
        for idx, node in enumerate(snapshot.nodes):
            entry = NodeEntry(node, idx, config)
            entry.rows_id = rows_ids.setdefault(entry.rows, len(rows_ids))
            node_ok = entry.reason is None
            grouped: dict[tuple[int, int | None], list[Slot]] = {}
            # the condition filters and device scores of the whole node, table line by line
            failures = condition_failures(node.devices, config)
            scores = device_parts(node.devices, config)
            for pos, dev in enumerate(node.devices):
                pkey = (
                    dev.device_type,
                    dev.model,
                    dev.hbm_memory_mb,
                    dev.supported_dtypes,
                    dev.fp16_tflops,
                    dev.bf16_tflops,
                    dev.int8_tflops,
                    dev.p2p_enabled,
                )
                profile = profile_ids.get(pkey)
                if profile is None:
                    profile = Profile(len(self.profiles), dev)
                    profile_ids[pkey] = profile
                    self.profiles.append(profile)
                    for metric in METRICS:
                        best[metric] = max(best[metric], tflops(dev, metric))
                failed = failures[pos]  # the stage of its first failing condition filter, or None
                slot = Slot(dev, idx, pos, profile, node_ok and failed is None, busy_above, scores[pos])
                entry.slots.append(slot)
                self.slots_by_name[dev.name] = slot
                if slot.schedulable:
                    schedulable.setdefault(profile.pid, {}).setdefault(idx, []).append(slot)
                    if not slot.allocated:
                        entry.free_count += 1
                grouped.setdefault((profile.pid, failed), []).append(slot)
            entry.groups = [
                Group(self.profiles[pid], failed, tuple(slots)) for (pid, failed), slots in grouped.items()
            ]
            self.nodes.append(entry)
        self.best_tflops = best
        self.max_node_devices = max((len(n.slots) for n in self.nodes), default=0)
        self._profile_pools: dict[int, LazyPool[RawKey, tuple[Slot, ...]]] = {}
        self._schedulable = schedulable
        self._subsets: dict[tuple[int, int], list[tuple[int, tuple[int, ...]]]] = {}

    def node_score(self, entry: NodeEntry) -> float:
        """Weighted spread/binpack score of a node at its current free count."""
        return node_part(entry.free_count, self.max_node_devices, self.config)

    def take(self, slot: Slot) -> None:
        """Use `slot` in this plan (placed, or reserved by a preemption); call `refresh` after."""
        if slot.taken:
            raise ValueError(f"device {slot.device.name} is already used in this plan")
        was_free = slot.free
        slot.taken = True
        entry = self.nodes[slot.node_idx]
        if was_free and slot.schedulable:
            entry.free_count -= 1
        entry.version += 1

    def refresh(self, node_idxs: Iterable[int]) -> None:
        """Re-evaluate nodes in every pool holding them (after `take`)."""
        for idx in node_idxs:
            for pool in self.nodes[idx].pools:
                pool.refresh(idx)

    def subsets(self, entry: NodeEntry, n: int) -> list[tuple[int, tuple[int, ...]]] | None:
        """Every n-subset of the node's device positions with its total distance, closest first;
        shared by nodes with the same topology. None above MAX_SUBSETS subsets."""
        m = len(entry.rows)
        if comb(m, n) > MAX_SUBSETS:
            return None
        key = (entry.rows_id, n)
        table = self._subsets.get(key)
        if table is None:
            table = sorted((set_distance(entry.rows, c), c) for c in combinations(range(m), n))
            self._subsets[key] = table
        return table

    def profile_pool(self, profile: Profile) -> LazyPool[RawKey, tuple[Slot, ...]]:
        """The pool of the best free schedulable device of `profile` per node (built on first use).

        Its keys carry type rank 0 and no compute score: both are constant within a profile, so a
        caller adds them for its own workload.
        """
        pool = self._profile_pools.get(profile.pid)
        if pool is None:
            pool = self._build_profile_pool(profile)
            self._profile_pools[profile.pid] = pool
        return pool

    def _build_profile_pool(self, profile: Profile) -> LazyPool[RawKey, tuple[Slot, ...]]:
        ranked = self._schedulable.get(profile.pid, {})
        for slots in ranked.values():
            slots.sort(key=lambda s: (s.busy, -s.score, s.pos))
        cursor = dict.fromkeys(ranked, 0)
        nodes, max_devices, config = self.nodes, self.max_node_devices, self.config

        def best_on(idx: int) -> tuple[RawKey, tuple[Slot, ...]] | None:  # on every take: plain tuples
            slots = ranked[idx]
            i = cursor[idx]
            while i < len(slots) and not slots[i].free:
                i += 1
            cursor[idx] = i
            if i == len(slots):
                return None
            slot = slots[i]
            entry = nodes[idx]
            score = node_part(entry.free_count, max_devices, config) + slot.score
            return (slot.busy, 0, 0, -score, entry.name, (slot.pos,)), (slot,)

        return LazyPool(self, ranked, best_on)


class LazyPool(Generic[K, V]):
    """A heap of each node's best (key, value), kept valid through node versions.

    `evaluate(node_idx)` gives the node's best (key, value) now, or None; smaller keys are better
    and must differ between nodes (they end with the node name), so values are never compared.
    """

    def __init__(
        self, index: ClusterIndex, node_idxs: Iterable[int], evaluate: Callable[[int], tuple[K, V] | None]
    ) -> None:
        self._index = index
        self._evaluate = evaluate
        self._heap: list[tuple[K, int, int, V]] = []
        nodes = index.nodes
        for idx in node_idxs:
            nodes[idx].pools.append(self)
            found = evaluate(idx)
            if found is not None:
                self._heap.append((found[0], nodes[idx].version, idx, found[1]))
        heapq.heapify(self._heap)

    def refresh(self, idx: int) -> None:
        """Push the current best of node `idx` (older entries of the node go stale)."""
        found = self._evaluate(idx)
        if found is not None:
            heapq.heappush(self._heap, (found[0], self._index.nodes[idx].version, idx, found[1]))

    def top(self) -> tuple[K, V] | None:
        """The best valid (key, value), or None when no node has one."""
        heap = self._heap
        nodes = self._index.nodes
        while heap:
            key, version, idx, value = heap[0]
            if version == nodes[idx].version:
                return key, value
            heapq.heappop(heap)
        return None
