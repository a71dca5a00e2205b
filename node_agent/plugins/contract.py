"""The device plugin contract: what the node agent asks of every plugin, in or out of process.

Modelled on the Kubernetes device plugin API (ListAndWatch, GetPreferredAllocation, Allocate) and
Nomad's device plugins (fingerprint + stats + reserve). A plugin serves the devices of one vendor
(`device_type`) on one node:

- `list_and_watch()` yields the plugin's devices (with status, reason and telemetry) at once and then
  a new list whenever something about them changes. It never ends on its own.
- `preferred_allocation(available, must_include, size, require_p2p)` picks `size` devices among
  `available` (plus every one of `must_include`) with the lowest total pairwise topology distance
  (see `choose_devices`).
- `allocate(devices)` says how an engine process gets those devices (`AllocateResult`): the vendor's
  visibility variable, the device nodes to expose and engine (SGLang) hints.

Per vendor, the runtime comes from the vendor's record (`node_agent.vendors.<type>`, `VENDOR.runtime`):
the variable holds the allocated indexes (logical ids), ascending, comma-separated ("0,1"); device nodes
list the per-device nodes (ascending index, each named by the device's node id: the physical id where a
vendor tells them apart, as Ascend does) and then the vendor's shared control nodes; engine hints are the
vendor's SGLang arguments.
"""

from __future__ import annotations

import abc
import itertools
import math
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field

from kunlun_common.api import plugin_pb2, types_pb2
from kunlun_common.errors import PermanentError
from kunlun_common.names import parse_device_name
from kunlun_common.states import DEVICE_STATE_OF_PROTO, DeviceState
from node_agent.vendors import vendor

__all__ = [
    "STATUS_NAMES",
    "AllocateResult",
    "DevicePlugin",
    "PluginError",
    "allocation_for",
    "choose_devices",
    "status_name",
    "total_distance",
]

STATUS_NAMES: Mapping[int, str] = DEVICE_STATE_OF_PROTO
UNKNOWN_DISTANCE = 1000  # distance assumed between two devices when neither row gives it
EXHAUSTIVE_LIMIT = 50_000  # above this many combinations, choose_devices searches greedily


def status_name(status: int) -> str:
    """ "Ready", "Unhealthy", "Unavailable", "Error" (or "Unknown")."""
    return DeviceState.of(status)


class PluginError(PermanentError):
    """A request a plugin cannot serve (unknown or foreign device, impossible size...); the message
    names the device or the value at fault."""


@dataclass(frozen=True)
class AllocateResult:
    """How an engine process gets the allocated devices."""

    envs: Mapping[str, str] = field(default_factory=dict)
    """Environment to set, e.g. {"ASCEND_RT_VISIBLE_DEVICES": "0,1"}."""
    device_nodes: tuple[str, ...] = ()
    """Device nodes to expose to the engine (same path on the host and inside its sandbox)."""
    engine_args: tuple[str, ...] = ()
    """Extra engine (SGLang) arguments, e.g. ("--device", "npu")."""

    def to_proto(self) -> plugin_pb2.AllocateResponse:
        return plugin_pb2.AllocateResponse(
            envs=dict(self.envs),
            device_nodes=[
                plugin_pb2.DeviceNode(host_path=p, container_path=p, permissions="rw")
                for p in self.device_nodes
            ],
            engine_args=list(self.engine_args),
        )

    @classmethod
    def from_proto(cls, msg: plugin_pb2.AllocateResponse) -> AllocateResult:
        return cls(
            envs=dict(msg.envs),
            device_nodes=tuple(n.host_path for n in msg.device_nodes),
            engine_args=tuple(msg.engine_args),
        )


def allocation_for(
    device_type: str, indexes: Sequence[int], node_ids: Mapping[int, int] | None = None
) -> AllocateResult:
    """The AllocateResult of `indexes` (device indexes of one vendor; `node_ids` maps an index to the id
    its device node is named by, when the vendor's tool says it differs); raises PluginError."""
    try:
        runtime = vendor(device_type).runtime
    except ValueError as e:
        raise PluginError(str(e)) from None
    if not indexes:
        raise PluginError(f"allocate: no {device_type} device given; name at least one")
    ordered = sorted(set(indexes))
    return AllocateResult(
        envs={runtime.visible_env: ",".join(str(i) for i in ordered)},
        device_nodes=runtime.device_nodes(node_ids or {}, ordered),
        engine_args=runtime.sglang_args,
    )


class DevicePlugin(abc.ABC):
    """One vendor's devices on one node. `name` is unique on the node; `device_type` is the vendor."""

    name: str
    device_type: str

    @abc.abstractmethod
    def list_and_watch(self) -> AsyncIterator[list[types_pb2.Device]]:
        """Yield the devices now, then a new list whenever a status, reason or telemetry changes."""

    @abc.abstractmethod
    async def preferred_allocation(
        self, available: Sequence[str], must_include: Sequence[str], size: int, require_p2p: bool
    ) -> list[str]:
        """`size` device names with the lowest total pairwise distance; raises PluginError."""

    @abc.abstractmethod
    async def allocate(self, devices: Sequence[str]) -> AllocateResult:
        """How an engine gets `devices` (names); raises PluginError naming an unknown device."""


# ------------------------------------------------------------------------------------ preferred allocation


@dataclass(frozen=True)
class _Candidate:
    name: str
    position: int
    device: types_pb2.Device


def _distance(a: _Candidate, b: _Candidate) -> int:
    row_a, row_b = a.device.topology_distance, b.device.topology_distance
    if b.position < len(row_a):
        return int(row_a[b.position])
    if a.position < len(row_b):
        return int(row_b[a.position])
    return UNKNOWN_DISTANCE


def _total(group: Sequence[_Candidate]) -> int:
    return sum(_distance(a, b) for a, b in itertools.combinations(group, 2))


def total_distance(
    devices: Mapping[str, types_pb2.Device], positions: Mapping[str, int], names: Sequence[str]
) -> int:
    """Sum of the pairwise topology distances between `names` (all keys of `devices` and `positions`)."""
    return _total([_Candidate(n, positions[n], devices[n]) for n in dict.fromkeys(names)])


def resolve_names(
    plugin: str, devices: Mapping[str, types_pb2.Device], names: Sequence[str]
) -> list[types_pb2.Device]:
    """The devices of `names` (duplicates dropped); a name the plugin does not serve raises PluginError
    saying whose device it is instead."""
    out: list[types_pb2.Device] = []
    for name in dict.fromkeys(names):
        device = devices.get(name)
        if device is None:
            raise PluginError(_foreign(plugin, devices, name))
        out.append(device)
    return out


def _foreign(plugin: str, devices: Mapping[str, types_pb2.Device], name: str) -> str:
    served = ", ".join(devices) or "no device"
    try:
        parsed = parse_device_name(name)
    except ValueError as e:
        return f"{e} (plugin {plugin} serves {served})"
    sample = next(iter(devices.values()), None)
    if sample is not None and parsed.node != sample.node:
        return f"{name} is a device of node {parsed.node}, not of node {sample.node} (plugin {plugin})"
    if sample is not None and parsed.device_type != sample.device_type:
        return (
            f"{name} is a {parsed.device_type} device; plugin {plugin} serves {sample.device_type} "
            f"devices only ({served})"
        )
    return f"{name} is not a device of plugin {plugin}: it is not declared (plugin {plugin} serves {served})"


def choose_devices(
    plugin: str,
    devices: Mapping[str, types_pb2.Device],
    positions: Mapping[str, int],
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    require_p2p: bool,
) -> list[str]:
    """Pick `size` devices: every one of `must_include`, the rest from `available`.

    `devices` are the plugin's devices by name and `positions` their column in the node's topology
    matrix (declaration order over every device of the node). The answer has the lowest total pairwise
    distance; ties go to the group whose positions sort first, so the answer is deterministic. It is
    listed in position order. With `require_p2p`, every chosen device must have p2p_enabled and all must
    be of one vendor. Up to EXHAUSTIVE_LIMIT combinations are tried exhaustively; beyond that a greedy
    search (grow from each seed, adding the device nearest to the group) gives a good, not always
    optimal, answer. Raises PluginError naming the device or the number at fault.
    """
    if size < 1:
        raise PluginError(f"preferred allocation: size must be at least 1, got {size}")
    must = [_Candidate(d.name, positions[d.name], d) for d in resolve_names(plugin, devices, must_include)]
    if len(must) > size:
        names = ", ".join(c.name for c in must)
        raise PluginError(
            f"preferred allocation: must_include names {len(must)} devices ({names}) but size is {size}"
        )
    chosen = {c.name for c in must}
    pool = [
        _Candidate(d.name, positions[d.name], d)
        for d in resolve_names(plugin, devices, available)
        if d.name not in chosen
    ]
    if require_p2p:
        pool = _p2p_pool(must, pool)
    pool.sort(key=lambda c: c.position)
    need = size - len(must)
    if need > len(pool):
        what = "P2P-enabled candidates" if require_p2p else "candidates"
        listed = ", ".join(c.name for c in pool) or "none"
        raise PluginError(
            f"preferred allocation: asked for {size} devices, {len(must)} required and only {len(pool)} "
            f"other {what} ({listed})"
        )
    if math.comb(len(pool), need) <= EXHAUSTIVE_LIMIT:
        best = _exhaustive(must, pool, need)
    else:
        best = _greedy(must, pool, need)
    return [c.name for c in sorted(best, key=lambda c: c.position)]


def _p2p_pool(must: list[_Candidate], pool: list[_Candidate]) -> list[_Candidate]:
    """The candidates that can join `must` over P2P: p2p_enabled and of the same vendor."""
    for c in must:
        if not c.device.p2p_enabled:
            raise PluginError(f"{c.name} must be included but has p2p_enabled: false, and P2P was required")
    pool = [c for c in pool if c.device.p2p_enabled]
    vendors = sorted({c.device.device_type for c in (*must, *pool)})
    if must:
        vendor = must[0].device.device_type
        other = next((c for c in must if c.device.device_type != vendor), None)
        if other is not None:
            raise PluginError(
                f"P2P was required but {other.name} is not a {vendor} device like {must[0].name}"
            )
        return [c for c in pool if c.device.device_type == vendor]
    if len(vendors) > 1:
        raise PluginError(f"P2P was required but the candidates mix vendors ({', '.join(vendors)})")
    return pool


def _key(group: Sequence[_Candidate]) -> tuple[int, list[int]]:
    return _total(group), sorted(c.position for c in group)


def _exhaustive(must: list[_Candidate], pool: list[_Candidate], need: int) -> list[_Candidate]:
    best: list[_Candidate] | None = None
    best_key: tuple[int, list[int]] | None = None
    for combo in itertools.combinations(pool, need):
        group = [*must, *combo]
        key = _key(group)
        if best_key is None or key < best_key:
            best, best_key = group, key
    assert best is not None
    return best


def _greedy(must: list[_Candidate], pool: list[_Candidate], need: int) -> list[_Candidate]:
    seeds: list[list[_Candidate]] = [must] if must else [[c] for c in pool]
    best: list[_Candidate] | None = None
    best_key: tuple[int, list[int]] | None = None
    for seed in seeds:
        group = list(seed)
        taken = {c.name for c in group}
        rest = [c for c in pool if c.name not in taken]
        while len(group) < len(must) + need:
            nearest = min(rest, key=lambda c: (sum(_distance(c, g) for g in group), c.position))
            group.append(nearest)
            rest.remove(nearest)
        key = _key(group)
        if best_key is None or key < best_key:
            best, best_key = group, key
    assert best is not None
    return best
