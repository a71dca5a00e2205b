"""Inputs and outputs of the pure placement function `schedule()`.

Everything here is a frozen dataclass: the leader builds a `GraphSnapshot` from etcd, hands it to
`schedule()` with the pending queue, and commits the returned `Plan` in fenced transactions.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType

PRIORITIES = ("high", "normal", "low")
"""Priority classes, most important first."""

PRIORITY_RANK: Mapping[str, int] = MappingProxyType({p: i for i, p in enumerate(PRIORITIES)})
"""0 for high, 1 for normal, 2 for low: a larger rank is a lower priority."""

QUANTIZATIONS = ("none", "w8a8", "int8", "fp8", "int4")
"""Quantizations the filters know; any other value needs that exact name in `supported_dtypes`."""


def _empty_attributes() -> Mapping[str, object]:
    return MappingProxyType({})


@dataclass(frozen=True)
class DeviceView:
    """One accelerator as the scheduler sees it in a snapshot."""

    name: str
    """Canonical `<node>/<type>:<index>` name, e.g. `node-a/ascend:0`."""
    node: str
    """Name of the node holding the device."""
    device_type: str
    """Vendor family: ascend, cambricon, hygon or nvidia."""
    index: int
    """Index of the device among the node's devices of the same type."""
    model: str
    """Product model, e.g. 910B, MLU370, A100."""
    hbm_memory_mb: int
    """On-device memory in MB; devices are exclusive, so all of it is free when the device is."""
    supported_dtypes: tuple[str, ...]
    """Precisions the runtime supports on this device, e.g. ("fp16", "bf16", "int8")."""
    fp16_tflops: float
    """Peak dense fp16 throughput."""
    bf16_tflops: float
    """Peak dense bf16 throughput."""
    int8_tflops: float
    """Peak dense int8 throughput (also used for w8a8, fp8 and int4 workloads)."""
    p2p_enabled: bool
    """Whether the device can exchange memory directly with its peers on the node."""
    topology_distance: tuple[int, ...]
    """Distance from this device to each device of the node, in node order (0 to itself)."""
    status: str
    """A `kunlun_common.states.DeviceState` value; only READY devices receive new work."""
    utilization_pct: float
    """Current compute utilization, 0 to 100."""
    temperature_c: float
    """Current temperature in degrees Celsius."""
    allocated_to: str | None = None
    """Instance id holding the device, or None when it is free."""
    custom_attributes: Mapping[str, object] = field(default_factory=_empty_attributes)
    """Free-form labels reported by the node agent; not used by the built-in filters."""


@dataclass(frozen=True)
class NodeView:
    """One node and its devices."""

    name: str
    """Node name (a DNS label)."""
    ready: bool
    """False once the node's agent has been silent past its grace period."""
    cordoned: bool
    """An operator asked for no new work on this node."""
    devices: tuple[DeviceView, ...]
    """Devices in node order; `DeviceView.topology_distance` rows are indexed by this order."""


@dataclass(frozen=True)
class GraphSnapshot:
    """The nodes and devices at one etcd revision."""

    nodes: tuple[NodeView, ...]
    """All nodes, in a stable order (ties in scoring fall back to node names, not to this order)."""
    revision: int
    """etcd revision the snapshot was read at; copied into `Plan.graph_revision` for fencing."""

    @cached_property
    def _nodes_by_name(self) -> Mapping[str, NodeView]:
        return MappingProxyType({n.name: n for n in self.nodes})

    @cached_property
    def _devices_by_name(self) -> Mapping[str, DeviceView]:
        return MappingProxyType({d.name: d for n in self.nodes for d in n.devices})

    def node(self, name: str) -> NodeView | None:
        """The node called `name`, or None."""
        return self._nodes_by_name.get(name)

    def device(self, name: str) -> DeviceView | None:
        """The device called `name` (`<node>/<type>:<index>`), or None."""
        return self._devices_by_name.get(name)

    def devices(self) -> Iterator[DeviceView]:
        """Every device, node by node, in node order."""
        for node in self.nodes:
            yield from node.devices


@dataclass(frozen=True)
class WorkloadReq:
    """What one instance of a workload needs."""

    workload_id: str
    """Id of the workload the instance belongs to."""
    name: str
    """Human name of the workload, e.g. llama3-8b."""
    model: str
    """Model served, e.g. meta-llama/Meta-Llama-3-8B."""
    quantization: str
    """none, w8a8, int8, fp8, int4...: int8 and w8a8 need int8 or w8a8 support, fp8 needs fp8,
    none needs `dtype`, anything else needs its own name in `supported_dtypes`."""
    dtype: str
    """Activation/weight precision when not quantized: fp16, bf16..."""
    devices_per_instance: int
    """Devices one instance spans; all on one node and of one device type."""
    memory_per_device_mb: int
    """HBM needed on each device, in MB."""
    priority: str = "normal"
    """high, normal or low."""
    preferred_device_types: tuple[str, ...] = ()
    """Allowed device types, most preferred first; empty allows every type."""
    pin: str | None = None
    """`ascend` (type), `ascend:0` (type and index on any node), `node-a/ascend` or `node-a/ascend:0`;
    only matching devices are candidates."""
    require_p2p: bool = False
    """For multi-device instances: every device must have p2p enabled (they are one type anyway)."""
    engine: str = "sglang"
    """The inference engine (`sglang` or `template`): SGLang cannot run on some vendors' devices
    (`kunlun_common.names.sglang_refusal`), so it is a placement input."""

    def __post_init__(self) -> None:
        if self.devices_per_instance < 1:
            raise ValueError(f"workload {self.workload_id}: devices_per_instance must be >= 1")
        if self.memory_per_device_mb < 0:
            raise ValueError(f"workload {self.workload_id}: memory_per_device_mb must be >= 0")


@dataclass(frozen=True)
class PendingInstance:
    """An instance waiting for devices."""

    instance_id: str
    """Unique id of the instance."""
    workload: WorkloadReq
    """What the instance needs."""
    enqueued_at: float
    """When the instance entered the queue, in seconds."""
    seq: int
    """Global submission order; FIFO within a priority class follows it."""


@dataclass(frozen=True)
class RunningInstance:
    """An instance holding devices; a candidate victim for preemption."""

    instance_id: str
    """Unique id of the instance."""
    workload: WorkloadReq
    """Its requirements (the priority decides whether it can be evicted)."""
    devices: tuple[str, ...]
    """Names of the devices it holds."""
    started_at: float = 0.0
    """When it started, in seconds; among equal priorities the newest is evicted first."""


@dataclass(frozen=True)
class Placement:
    """A decision to start one pending instance on devices of one node."""

    instance_id: str
    """The pending instance placed."""
    node: str
    """Node of every device in `devices`."""
    devices: tuple[str, ...]
    """Device names, in node order."""
    score: float
    """Score of the chosen devices (higher is better); informative only."""
    preempts: tuple[str, ...] = ()
    """Running instances to evict first so that `devices` are free (empty without preemption)."""


@dataclass(frozen=True)
class Unplaced:
    """A pending instance no node can take now, with the reason from each node."""

    instance_id: str
    """The pending instance."""
    reasons: Mapping[str, str]
    """Node name -> reason, e.g. {"node-b": "CardTypeMismatch"}, in snapshot node order."""


@dataclass(frozen=True)
class Plan:
    """The output of `schedule()`."""

    placements: tuple[Placement, ...]
    """Decisions in queue order; no device appears twice."""
    unplaced: tuple[Unplaced, ...]
    """Instances examined but not placed, in queue order."""
    decided_at: float
    """The `now` given to `schedule()`."""
    graph_revision: int
    """Revision of the snapshot the plan was computed from."""
