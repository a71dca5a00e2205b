"""The device plugin contract: preferred allocation (topology, P2P, determinism) and allocate per vendor."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kunlun_common.api import plugin_pb2, types_pb2
from node_agent.plugins.config import NodeConfig, load_config, parse_config
from node_agent.plugins.contract import (
    EXHAUSTIVE_LIMIT,
    AllocateResult,
    PluginError,
    allocation_for,
    choose_devices,
    total_distance,
)
from node_agent.plugins.vendor_plugin import VendorPlugin

EXAMPLES = Path(__file__).resolve().parents[1] / "deploy" / "examples"
A = [f"node-a/ascend:{i}" for i in range(4)]


def example(name: str) -> NodeConfig:
    return load_config(EXAMPLES / f"{name}.yaml")


def plugin(config: NodeConfig, device_type: str) -> VendorPlugin:
    return VendorPlugin(config, device_type, env={"PATH": ""})  # allocation never runs the tool


@pytest.fixture(scope="module")
def node_a() -> VendorPlugin:
    return plugin(example("node-a"), "ascend")


# ---------------------------------------------------------------- preferred allocation


async def test_node_a_rows_are_the_documented_matrix(node_a: VendorPlugin) -> None:
    rows = [list(d.topology_distance) for d in node_a.devices()]
    assert rows == [[0, 1, 2, 2], [1, 0, 2, 2], [2, 2, 0, 1], [2, 2, 1, 0]]


async def test_picks_the_lowest_distance_pair(node_a: VendorPlugin) -> None:
    # (0,1) and (2,3) both cost 1; the tie goes to the lower positions, every time.
    for _ in range(3):
        assert await node_a.preferred_allocation(A, [], 2, False) == A[:2]
    assert await node_a.preferred_allocation(A[1:], [], 2, False) == A[2:]
    assert await node_a.preferred_allocation(list(reversed(A)), [], 2, False) == A[:2]
    assert node_a.total_distance(A[:2]) == 1
    assert node_a.total_distance([A[0], A[2]]) == 2


async def test_must_include_pulls_in_its_nearest_partner(node_a: VendorPlugin) -> None:
    assert await node_a.preferred_allocation(A, [A[3]], 2, False) == [A[2], A[3]]
    assert await node_a.preferred_allocation([A[0], A[2]], [A[3]], 2, False) == [A[2], A[3]]
    assert await node_a.preferred_allocation(A, [A[1], A[2]], 2, False) == [A[1], A[2]]


async def test_larger_groups_and_ties(node_a: VendorPlugin) -> None:
    # {0,1,2} and {0,1,3}, {0,2,3}, {1,2,3} all cost 5: the lowest positions win.
    assert await node_a.preferred_allocation(A, [], 3, False) == A[:3]
    assert await node_a.preferred_allocation(A, [], 4, False) == A
    assert node_a.total_distance(A) == 1 + 2 + 2 + 2 + 2 + 1


async def test_impossible_requests_say_why(node_a: VendorPlugin) -> None:
    with pytest.raises(PluginError, match="size must be at least 1"):
        await node_a.preferred_allocation(A, [], 0, False)
    with pytest.raises(PluginError, match=r"asked for 3 devices.*only 2"):
        await node_a.preferred_allocation(A[:2], [], 3, False)
    with pytest.raises(PluginError, match=r"must_include names 2 devices .* but size is 1"):
        await node_a.preferred_allocation(A, A[:2], 1, False)


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("node-a/ascend:9", "node-a/ascend:9 is not a device of plugin ascend: it is not declared"),
        ("node-b/ascend:0", "node-b/ascend:0 is a device of node node-b, not of node node-a"),
        ("node-a/nvidia:0", "node-a/nvidia:0 is a nvidia device; plugin ascend serves ascend devices only"),
        ("ascend0", "invalid device name 'ascend0'"),
    ],
)
async def test_unknown_and_foreign_devices_are_named(node_a: VendorPlugin, name: str, says: str) -> None:
    with pytest.raises(PluginError) as err:
        await node_a.preferred_allocation([*A, name], [], 2, False)
    assert says in str(err.value)
    with pytest.raises(PluginError) as err:
        await node_a.preferred_allocation(A, [name], 2, False)
    assert says in str(err.value)
    with pytest.raises(PluginError) as err:
        await node_a.allocate([A[0], name])
    assert says in str(err.value)


MIXED_P2P = """
schema_version: 1
node: {name: node-a, address: 127.0.0.1, simulated: true}
devices:
  - device_type: ascend
    device_id: 0
    model: 910B
    p2p_enabled: true
    topology_distance: [0, 1, 2, 2]
    hbm_memory_mb: 32768
    supported_dtypes: [fp16]
  - device_type: ascend
    device_id: 1
    model: 910B
    p2p_enabled: false
    topology_distance: [1, 0, 2, 2]
    hbm_memory_mb: 32768
    supported_dtypes: [fp16]
  - device_type: ascend
    device_ids: [2, 3]
    model: 910B
    p2p_enabled: true
    topology_distance: [[2, 2, 0, 1], [2, 2, 1, 0]]
    hbm_memory_mb: 32768
    supported_dtypes: [fp16]
"""


async def test_p2p_requirement() -> None:
    p = plugin(parse_config(MIXED_P2P), "ascend")
    assert await p.preferred_allocation(A, [], 2, False) == A[:2]  # nearest pair, P2P or not
    assert await p.preferred_allocation(A, [], 2, True) == A[2:]  # ascend:1 cannot take part
    assert await p.preferred_allocation(A, [A[0]], 2, True) == [A[0], A[2]]
    with pytest.raises(PluginError, match=r"node-a/ascend:1 must be included but has p2p_enabled: false"):
        await p.preferred_allocation(A, [A[1]], 2, True)
    with pytest.raises(PluginError, match=r"only 2 other P2P-enabled candidates"):
        await p.preferred_allocation(A, [A[0]], 4, True)


async def test_p2p_on_node_b_links_the_mlus_only() -> None:
    config = example("node-b")
    mlu = plugin(config, "cambricon")
    assert await mlu.preferred_allocation(["node-b/cambricon:0", "node-b/cambricon:1"], [], 2, True) == [
        "node-b/cambricon:0",
        "node-b/cambricon:1",
    ]
    gpu = plugin(config, "nvidia")
    assert await gpu.preferred_allocation(["node-b/nvidia:0"], [], 1, False) == ["node-b/nvidia:0"]
    with pytest.raises(PluginError, match="node-b/nvidia:0 must be included but has p2p_enabled: false"):
        await gpu.preferred_allocation([], ["node-b/nvidia:0"], 1, True)
    with pytest.raises(PluginError, match=r"only 0 other P2P-enabled candidates \(none\)"):
        await gpu.preferred_allocation(["node-b/nvidia:0"], [], 1, True)


def _clustered(n: int, group: int) -> tuple[dict[str, types_pb2.Device], dict[str, int]]:
    """n devices in groups of `group`: distance 1 within a group, 3 across."""
    devices, positions = {}, {}
    for i in range(n):
        row = [0 if j == i else (1 if j // group == i // group else 3) for j in range(n)]
        name = f"big/nvidia:{i}"
        devices[name] = types_pb2.Device(
            name=name, node="big", device_type="nvidia", index=i, topology_distance=row, p2p_enabled=True
        )
        positions[name] = i
    return devices, positions


def test_large_nodes_use_the_greedy_search_and_still_find_a_group() -> None:
    devices, positions = _clustered(48, 8)
    names = list(devices)
    available = names[3:]  # group 0 is incomplete: the answer is group 1
    chosen = choose_devices("nvidia", devices, positions, available, [], 8, True)
    assert chosen == names[8:16]
    assert total_distance(devices, positions, chosen) == 28
    must = choose_devices("nvidia", devices, positions, names, [names[41]], 8, False)
    assert must == names[40:48]
    assert math.comb(45, 8) > EXHAUSTIVE_LIMIT  # the greedy path really ran


# ---------------------------------------------------------------- allocate


async def test_allocate_ascend(node_a: VendorPlugin) -> None:
    result = await node_a.allocate([A[3], A[1], A[3]])
    assert result == AllocateResult(
        envs={"ASCEND_RT_VISIBLE_DEVICES": "1,3"},
        device_nodes=(
            "/dev/davinci1",
            "/dev/davinci3",
            "/dev/davinci_manager",
            "/dev/devmm_svm",
            "/dev/hisi_hdc",
        ),
        engine_args=("--device", "npu", "--attention-backend", "ascend"),
    )


async def test_allocate_cambricon_and_nvidia() -> None:
    config = example("node-b")
    assert await plugin(config, "cambricon").allocate(["node-b/cambricon:1"]) == AllocateResult(
        envs={"MLU_VISIBLE_DEVICES": "1"},
        device_nodes=("/dev/cambricon_dev1", "/dev/cambricon_ctl"),
        engine_args=(),
    )
    assert await plugin(config, "cambricon").allocate(["node-b/cambricon:0", "node-b/cambricon:1"]) == (
        AllocateResult(
            envs={"MLU_VISIBLE_DEVICES": "0,1"},
            device_nodes=("/dev/cambricon_dev0", "/dev/cambricon_dev1", "/dev/cambricon_ctl"),
        )
    )
    assert await plugin(config, "nvidia").allocate(["node-b/nvidia:0"]) == AllocateResult(
        envs={"CUDA_VISIBLE_DEVICES": "0"},
        device_nodes=("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"),
        engine_args=(),  # CUDA is SGLang's default device
    )
    with pytest.raises(PluginError, match="node-b/cambricon:0 is a cambricon device; plugin nvidia serves"):
        await plugin(config, "nvidia").allocate(["node-b/cambricon:0"])


async def test_allocate_hygon_maps_cards_to_render_nodes() -> None:
    dcu = plugin(example("hygon-k100-x8"), "hygon")
    assert await dcu.allocate(["dcu-01/hygon:5", "dcu-01/hygon:0"]) == AllocateResult(
        envs={"HIP_VISIBLE_DEVICES": "0,5"},
        device_nodes=("/dev/dri/renderD128", "/dev/dri/renderD133", "/dev/kfd"),
        engine_args=(),  # SGLang's AMD guide: no --device, the ROCm build detects the device
    )


def test_allocation_for_refuses_nothing_and_unknown_types() -> None:
    with pytest.raises(PluginError, match="no ascend device given"):
        allocation_for("ascend", [])
    with pytest.raises(PluginError, match="unknown device type 'tpu'"):
        allocation_for("tpu", [0])


def test_allocate_result_round_trips_through_the_proto() -> None:
    result = allocation_for("nvidia", [2, 0])
    msg = result.to_proto()
    assert isinstance(msg, plugin_pb2.AllocateResponse)
    first = msg.device_nodes[0]
    assert (first.host_path, first.container_path, first.permissions) == (
        "/dev/nvidia0",
        "/dev/nvidia0",
        "rw",
    )
    assert (
        AllocateResult.from_proto(plugin_pb2.AllocateResponse.FromString(msg.SerializeToString())) == result
    )
