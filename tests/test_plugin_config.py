"""The strict device-plugin-config loader: every field, every error, the JSON Schema, random input."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kunlun_common.errors import ConfigError, PermanentError
from kunlun_common.names import DEVICE_TYPES, NODE_NAME_RE, parse_device_name
from node_agent.plugins.config import (
    ConfigFileError,
    DeviceDecl,
    NodeConfig,
    Problem,
    load_config,
    parse_config,
    schema_path,
)
from node_agent.plugins.config_schema import (
    ATTRIBUTE_TYPES,
    DEVICE_FIELDS,
    DEVICE_ID,
    DEVICE_ONE_OF,
    DISTANCE,
    DTYPES,
    MAX_DEVICES,
    NO_DEFAULT,
    NODE_FIELDS,
    ROOT_FIELDS,
    FieldSpec,
)
from node_agent.plugins.config_yaml import MappingNode, Node, ScalarNode, SequenceNode, compose, scalar_value

EXAMPLES = Path(__file__).resolve().parents[1] / "deploy" / "examples"
VENDOR_EXAMPLES = ("ascend-910b-x8", "cambricon-mlu370-x4", "hygon-k100-x8", "nvidia-a100-x8")
SCHEMA: dict[str, Any] = json.loads(schema_path().read_text())
Json = Any


# ---------------------------------------------------------------- helpers


def base() -> dict[str, Json]:
    """A valid two-device, two-vendor config."""
    return {
        "schema_version": 1,
        "node": {"name": "node-a", "address": "127.0.0.1", "simulated": True},
        "devices": [
            {
                "device_type": "ascend",
                "device_id": 0,
                "model": "910B",
                "topology_distance": [0, 5],
                "hbm_memory_mb": 32768,
                "supported_dtypes": ["fp16"],
            },
            {
                "device_type": "nvidia",
                "device_id": 1,
                "model": "A100",
                "topology_distance": [5, 0],
                "hbm_memory_mb": 40960,
                "supported_dtypes": ["fp16", "fp8"],
            },
        ],
    }


def as_json(value: Json) -> str:
    """JSON, with the characters YAML does not allow raw written as escapes."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    return re.sub("[\x7f-\x9f\u2028\u2029\ufffe\uffff]", lambda m: f"\\u{ord(m[0]):04x}", text)


def dump(data: Json, indent: str = "") -> str:
    """YAML text with one line per key: mappings in block style, everything else as JSON (which is
    YAML 1.2 and quotes every string, so the loader sees exactly these types)."""
    if not isinstance(data, dict) or not data:
        return indent + as_json(data) + "\n"
    out = []
    for key, value in data.items():
        head = indent + as_json(key)
        if isinstance(value, dict) and value:
            out.append(f"{head}:\n{dump(value, indent + '  ')}")
        elif isinstance(value, list) and value and all(isinstance(v, dict) and v for v in value):
            out.append(f"{head}:\n" + "".join(f"{indent}  -\n{dump(v, indent + '    ')}" for v in value))
        else:
            out.append(f"{head}: {as_json(value)}\n")
    return "".join(out)


def parse(data: Json) -> NodeConfig:
    return parse_config(dump(data), "t.yaml")


def problems(data: Json | str) -> list[Problem]:
    """All problems the loader reports, file-level (raised) or device-level."""
    try:
        cfg = parse_config(data if isinstance(data, str) else dump(data), "t.yaml")
    except ConfigFileError as e:
        return e.problems
    return list(cfg.problems)


def fatal(data: Json | str) -> list[str]:
    with pytest.raises(ConfigFileError) as info:
        parse_config(data if isinstance(data, str) else dump(data), "t.yaml")
    assert str(info.value) == "\n".join(str(p) for p in info.value.problems)
    return [str(p) for p in info.value.problems]


def device_errors(data: Json, index: int = 0) -> list[str]:
    cfg = parse(data)
    return [str(p) for p in cfg.devices[index].errors]


def with_device(**fields: Json) -> dict[str, Json]:
    data = base()
    for key, value in fields.items():
        if value is DELETE:
            data["devices"][0].pop(key, None)
        else:
            data["devices"][0][key] = value
    return data


DELETE = object()


def four_ascend(row2: str) -> str:
    """The brief's example: one single device and a group of three, device 2's row given."""
    return f"""\
schema_version: 1
node:
  name: node-a
  address: 127.0.0.1
devices:
  - device_type: ascend
    device_id: 0
    model: 910B
    topology_distance: [0, 1, 2, 2]
    hbm_memory_mb: 32768
    supported_dtypes: [fp16, bf16, int8]
  - device_type: ascend
    device_ids: [1, 2, 3]
    model: 910B
    topology_distance:
      - [1, 0, 2, 2]
      - {row2}
      - [2, 2, 1, 0]
    hbm_memory_mb: 32768
    supported_dtypes: [fp16, bf16, int8]
"""


# ---------------------------------------------------------------- examples and every field


@pytest.mark.parametrize("name", [*VENDOR_EXAMPLES, "node-a", "node-b"])
def test_examples_load_cleanly_and_match_the_schema(name: str) -> None:
    path = EXAMPLES / f"{name}.yaml"
    cfg = load_config(path)
    assert cfg.path == str(path)
    assert cfg.devices and all(d.ok for d in cfg.devices), cfg.problems
    n = len(cfg.devices)
    assert all(len(d.topology_distance) == n for d in cfg.devices)
    assert validate(SCHEMA, yaml.safe_load(path.read_text())) == []


def test_node_a_demo() -> None:
    cfg = load_config(EXAMPLES / "node-a.yaml")
    assert (cfg.node_name, cfg.address, cfg.simulated) == ("node-a", "127.0.0.1", True)
    assert [cfg.device_name(d) for d in cfg.devices] == [f"node-a/ascend:{i}" for i in range(4)]
    assert [d.topology_distance for d in cfg.devices] == [
        (0, 1, 2, 2),
        (1, 0, 2, 2),
        (2, 2, 0, 1),
        (2, 2, 1, 0),
    ]
    for d in cfg.devices:
        assert (d.model, d.hbm_memory_mb, d.total_memory_mb, d.p2p_enabled) == ("910B", 32768, 32768, True)
        assert (d.fp16_tflops, d.bf16_tflops, d.int8_tflops) == (320.0, 320.0, 640.0)
        assert d.supported_dtypes == ("fp16", "bf16", "int8")
        assert d.custom_attributes == {"aclnn_fusion_enabled": True}


def test_node_b_demo() -> None:
    cfg = load_config(EXAMPLES / "node-b.yaml")
    assert (cfg.node_name, cfg.address, cfg.simulated) == ("node-b", "127.0.0.1", True)
    names = [cfg.device_name(d) for d in cfg.devices]
    assert names == ["node-b/cambricon:0", "node-b/cambricon:1", "node-b/nvidia:0"]
    mlu0, mlu1, gpu = cfg.devices
    assert (mlu0.model, mlu0.total_memory_mb, mlu0.hbm_memory_mb) == ("MLU370", 49152, 49152)
    assert mlu0.supported_dtypes == ("fp16", "bf16", "int8")
    assert mlu1.custom_attributes == {"mlu_stream_priority": "high"}
    assert (gpu.model, gpu.hbm_memory_mb, gpu.supported_dtypes) == (
        "A100-SXM4-40GB",
        40960,
        ("fp16", "bf16", "int8", "fp8"),
    )
    assert (mlu0.p2p_enabled, mlu1.p2p_enabled, gpu.p2p_enabled) == (True, True, False)
    matrix = [d.topology_distance for d in cfg.devices]
    assert all(matrix[i][j] == matrix[j][i] for i in range(3) for j in range(3))
    assert matrix[0][1] < matrix[0][2] and matrix[2][0] >= 10


def test_every_field_is_read() -> None:
    text = """\
schema_version: 1
node:
  name: edge-7
  address: node-7.cluster.local
  simulated: false
  simulator_state: /var/lib/kunlun/sim.json
  health_interval_seconds: 0.5
  plugin_socket_dir: /run/kunlun/plugins
devices:
  - device_type: hygon
    device_id: 3
    model: K100
    p2p_enabled: true
    p2p_bandwidth_gbps: 64.5
    topology_distance: [0]
    total_memory_mb: 70000
    hbm_memory_mb: 65536
    sys_memory_mb: 1024
    fp16_compute_power_tflops: 196
    bf16_compute_power_tflops: 195.5
    int8_compute_power_tflops: 392
    supported_dtypes: [fp32, fp16, bf16, int8, int4, fp8, w8a8]
    custom_attributes: {s: text, i: 3, f: 2.5, b: false, day: 2024-01-01, y: yes, o: 0o17}
"""
    cfg = parse_config(text, "f.yaml")
    assert cfg == NodeConfig(
        path="f.yaml",
        node_name="edge-7",
        address="node-7.cluster.local",
        simulated=False,
        simulator_state="/var/lib/kunlun/sim.json",
        health_interval_seconds=0.5,
        plugin_socket_dir="/run/kunlun/plugins",
        devices=(
            DeviceDecl(
                device_type="hygon",
                device_id=3,
                model="K100",
                p2p_enabled=True,
                p2p_bandwidth_gbps=64.5,
                topology_distance=(0,),
                total_memory_mb=70000,
                hbm_memory_mb=65536,
                sys_memory_mb=1024,
                fp16_tflops=196.0,
                bf16_tflops=195.5,
                int8_tflops=392.0,
                supported_dtypes=("fp32", "fp16", "bf16", "int8", "int4", "fp8", "w8a8"),
                # YAML 1.2 core, as editors read it: dates and yes are strings, 0o17 is octal
                custom_attributes={
                    "s": "text",
                    "i": 3,
                    "f": 2.5,
                    "b": False,
                    "day": "2024-01-01",
                    "y": "yes",
                    "o": 15,
                },
                line=10,
            ),
        ),
    )
    assert cfg.device_name(cfg.devices[0]) == "edge-7/hygon:3"
    assert parse_device_name(cfg.device_name(cfg.devices[0])).index == 3
    assert cfg.devices[0].ok and cfg.problems == ()


def test_defaults() -> None:
    data = base()
    data["node"] = {"name": "node-a", "address": "10.0.0.1"}
    data["devices"] = [
        {
            "device_type": "nvidia",
            "device_id": 1,
            "model": "A100",
            "hbm_memory_mb": 40960,
            "supported_dtypes": ["fp16"],
        }
    ]
    cfg = parse(data)
    assert (cfg.simulated, cfg.simulator_state, cfg.health_interval_seconds, cfg.plugin_socket_dir) == (
        False,
        None,
        1.0,
        None,
    )
    (d,) = cfg.devices
    assert d.ok
    assert (d.total_memory_mb, d.sys_memory_mb, d.p2p_enabled, d.p2p_bandwidth_gbps) == (40960, 0, False, 0.0)
    assert (d.fp16_tflops, d.bf16_tflops, d.int8_tflops, d.custom_attributes) == (0.0, 0.0, 0.0, {})
    assert d.topology_distance == (0,)  # one device: the 1x1 matrix needs no declaration


def test_explicit_nulls_for_optional_paths() -> None:
    data = base()
    data["node"].update(simulator_state=None, plugin_socket_dir=None)
    cfg = parse(data)
    assert (cfg.simulator_state, cfg.plugin_socket_dir) == (None, None)


def test_groups_expand_in_declaration_order_across_vendors() -> None:
    text = """\
schema_version: 1
node: {name: n1, address: 127.0.0.1}
devices:
  - {device_type: nvidia, device_ids: [7, 3], model: A100, hbm_memory_mb: 1, supported_dtypes: [fp16],
     topology_distance: [[0, 1, 9], [1, 0, 9]]}
  - {device_type: ascend, device_id: 3, model: 910B, hbm_memory_mb: 1, supported_dtypes: [fp16],
     topology_distance: [9, 9, 0]}
"""
    cfg = parse_config(text)
    assert [cfg.device_name(d) for d in cfg.devices] == ["n1/nvidia:7", "n1/nvidia:3", "n1/ascend:3"]
    assert [d.topology_distance for d in cfg.devices] == [(0, 1, 9), (1, 0, 9), (9, 9, 0)]
    assert [d.line for d in cfg.devices] == [4, 4, 6]


def test_anchors_and_aliases_are_followed() -> None:
    text = """\
schema_version: 1
node: {name: n1, address: 127.0.0.1}
devices:
  - {device_type: ascend, device_id: 0, model: 910B, hbm_memory_mb: &mem 32768,
     supported_dtypes: &dt [fp16, bf16], topology_distance: [0, 1]}
  - {device_type: ascend, device_id: 1, model: 910B, hbm_memory_mb: *mem,
     supported_dtypes: *dt, topology_distance: [1, 0]}
"""
    cfg = parse_config(text)
    assert [d.hbm_memory_mb for d in cfg.devices] == [32768, 32768]
    assert cfg.devices[1].supported_dtypes == ("fp16", "bf16") and cfg.devices[1].ok


def test_schema_path_is_shipped_next_to_the_loader() -> None:
    path = schema_path()
    assert path.name == "device-plugin-config.schema.json" and path.parent.name == "plugins"
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"


# ---------------------------------------------------------------- topology


def test_short_topology_row_names_device_matrix_and_values() -> None:
    cfg = parse_config(four_ascend("[0, 1, 2]"), "node-a.yaml")
    bad = cfg.devices[2]
    assert [str(p) for p in bad.errors] == [
        "node-a.yaml:17: devices[1].topology_distance[1] (node-a/ascend:2): expected a row of 4 distances for "
        "this device (the node declares 4 devices: a 4x4 matrix, 16 values), found 3 values [0, 1, 2]; "
        "list its distance to every device of the node in declaration order, 0 for itself"
    ]
    assert bad.topology_distance == () and not bad.ok
    assert [d.ok for d in cfg.devices] == [True, True, False, True]  # the others still serve
    assert cfg.problems == bad.errors
    p = bad.errors[0]
    assert (p.path, p.line, p.field) == (
        "node-a.yaml",
        17,
        "devices[1].topology_distance[1] (node-a/ascend:2)",
    )


def test_asymmetric_matrix_names_both_devices_and_values() -> None:
    cfg = parse_config(four_ascend("[2, 1, 0, 1]"), "node-a.yaml")
    expected = (
        "expected the same distance both ways between node-a/ascend:1 and node-a/ascend:2 (a symmetric matrix), "
        "found node-a/ascend:1 -> node-a/ascend:2 = 2 (line 16) but node-a/ascend:2 -> node-a/ascend:1 = 1 "
        "(line 17); make the two values equal"
    )
    assert [str(p) for p in cfg.devices[1].errors] == [
        f"node-a.yaml:16: devices[1].topology_distance[0][2] (node-a/ascend:1): {expected}"
    ]
    assert [str(p) for p in cfg.devices[2].errors] == [
        f"node-a.yaml:17: devices[1].topology_distance[1][1] (node-a/ascend:2): {expected}"
    ]
    assert [d.ok for d in cfg.devices] == [True, False, False, True]
    assert cfg.devices[2].topology_distance == (2, 1, 0, 1)  # well-formed, kept


def test_nonzero_diagonal() -> None:
    cfg = parse_config(four_ascend("[2, 2, 5, 1]"), "node-a.yaml")
    assert [str(p) for p in cfg.devices[2].errors] == [
        "node-a.yaml:17: devices[1].topology_distance[1][2] (node-a/ascend:2): expected 0 at position 2, "
        "the distance from node-a/ascend:2 to itself, found 5"
    ]


def test_topology_value_errors() -> None:
    errs = device_errors(with_device(topology_distance=[0, -1]))
    assert errs == [
        "t.yaml:11: devices[0].topology_distance[1] (node-a/ascend:0): expected an integer >= 0, "
        "found integer -1; negative values are refused"
    ]
    errs = device_errors(with_device(topology_distance=[0, "far"]))
    assert 'found string "far"' in errs[0]


def test_topology_missing_when_several_devices() -> None:
    (err,) = device_errors(with_device(topology_distance=DELETE))
    assert err == (
        "t.yaml:8: devices[0].topology_distance (node-a/ascend:0): expected a row of 2 distances for this "
        "device (the node declares 2 devices: a 2x2 matrix, 4 values), found nothing (the key is missing); "
        "list its distance to every device of the node in declaration order, 0 for itself"
    )


def test_topology_shapes() -> None:
    (err,) = device_errors(with_device(topology_distance=[[0, 5]]))
    assert "found 1 value [[0, 5]]; device_id declares one device: write its row as one list" in err
    data = with_device(device_id=DELETE, device_ids=[0, 1], topology_distance=[[0, 1, 5], [1, 0, 5]])
    data["devices"][1]["topology_distance"] = [5, 5, 0]
    assert parse(data).problems == ()
    data["devices"][0]["topology_distance"] = [[0, 1, 5]]
    (err,) = [str(p) for p in parse(data).problems]
    assert err.startswith("t.yaml:10: devices[0].topology_distance (node-a/ascend:0, node-a/ascend:1): ")
    assert (
        "expected 2 rows, one per device of device_ids, each a row of 3 distances (a 3x3 matrix), found 1 row"
        in err
    )
    data["devices"][0]["topology_distance"] = [0, 1]
    cfg = parse(data)
    assert "device_ids declares a group: give one row (a list) per device" in str(cfg.devices[0].errors[0])
    assert not cfg.devices[0].ok and not cfg.devices[1].ok and cfg.devices[2].ok


# ---------------------------------------------------------------- device-level problems


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "hbm_memory_mb",
            "32GB",
            'expected an integer >= 1 (MB), found string "32GB"; write the number of MB, e.g. 32768',
        ),
        ("hbm_memory_mb", "40 GiB", "write the number of MB, e.g. 40960"),
        ("hbm_memory_mb", "32768", 'found string "32768"; remove the quotes: 32768'),
        ("hbm_memory_mb", -1, "found integer -1; negative values are refused"),
        ("hbm_memory_mb", 0, "expected an integer >= 1 (MB), found integer 0"),
        ("hbm_memory_mb", 1.5, "found number 1.5; write a whole number"),
        ("hbm_memory_mb", 2**63, "expected an integer >= 1 (MB) and <= 9223372036854775807"),
        ("total_memory_mb", 100, "expected total_memory_mb >= hbm_memory_mb (32768), found 100"),
        ("sys_memory_mb", True, "found boolean true; write a number, not true/false"),
        ("fp16_compute_power_tflops", "320 TFLOPS", "write the number of TFLOPS without the unit, e.g. 320"),
        ("bf16_compute_power_tflops", -0.5, "expected a number >= 0 (TFLOPS), found number -0.5"),
        ("int8_compute_power_tflops", None, "found null"),
        ("p2p_bandwidth_gbps", [56], "found a list [56]"),
        ("p2p_enabled", "true", 'expected true or false, found string "true"; remove the quotes: true'),
        ("p2p_enabled", "yes", "YAML 1.1 read yes/no/on/off as booleans, YAML 1.2 and editors do not"),
        ("p2p_enabled", 1, "found integer 1; write true or false, not a number"),
        ("model", 910, 'expected a non-empty string, found integer 910; quote it: model: "910"'),
        ("model", "", "expected a non-empty string, found an empty string"),
        ("supported_dtypes", "fp16", 'found string "fp16"; write a list: [fp16]'),
        ("supported_dtypes", [], "found an empty list"),
        ("supported_dtypes", ["float16"], "found string \"float16\"; did you mean 'fp16'?"),
        (
            "supported_dtypes",
            ["fp16", "fp16"],
            "supported_dtypes[1] (node-a/ascend:0): expected each dtype once",
        ),
        ("supported_dtypes", ["fp16", 8], "supported_dtypes[1] (node-a/ascend:0): expected one of fp32"),
        ("custom_attributes", [1], "expected a mapping of names to strings, numbers or booleans"),
        (
            "custom_attributes",
            {"a": None},
            "custom_attributes.a (node-a/ascend:0): expected a string, number",
        ),
        ("custom_attributes", {"a": {"b": 1}}, "flatten it to scalar values"),
        (
            "hbm_mem_mb",
            1,
            "expected a known key, found unknown key 'hbm_mem_mb'; did you mean 'hbm_memory_mb'?",
        ),
        ("fp16_tflops", 1, "did you mean 'fp16_compute_power_tflops'?"),
        ("Model", "x", "write it in lowercase: 'model'"),
        ("<<", {}, "YAML merge keys are not supported"),
    ],
)
def test_device_field_errors(field: str, value: Json, message: str) -> None:
    cfg = parse(with_device(**{field: value}))
    errs = [str(p) for p in cfg.devices[0].errors]
    assert len(errs) == 1 and message in errs[0], errs
    assert errs[0].startswith("t.yaml:") and "devices[0]." in errs[0] and "(node-a/ascend:0)" in errs[0]
    assert cfg.devices[1].ok  # the other device serves


def test_key_messages_exactly() -> None:
    cfg = parse(with_device(hbm_memory_mb="32GB", hbm_mem_mb=1))
    assert [str(p) for p in cfg.devices[0].errors] == [
        't.yaml:12: devices[0].hbm_memory_mb (node-a/ascend:0): expected an integer >= 1 (MB), found string "32GB"; '
        "write the number of MB, e.g. 32768",
        "t.yaml:14: devices[0].hbm_mem_mb (node-a/ascend:0): expected a known key, found unknown key 'hbm_mem_mb'; "
        "did you mean 'hbm_memory_mb'?",
    ]


def test_odd_scalars() -> None:
    text = dump(base())
    cases = {
        '"hbm_memory_mb": 32768': (
            '"hbm_memory_mb": !!binary aGVsbG8=',
            "found a value tagged tag:yaml.org,2002:binary: 'aGVsbG8='",
        ),
        '"model": "910B"': ('"model": "\\ud800"', "found text with a lone UTF-16 surrogate (not Unicode)"),
        '"device_id": 0': (
            '"device_id": 0\n    "custom_attributes": {1: x}',
            "expected string keys, found integer 1",
        ),
        '"device_type": "ascend"': (
            '"device_type": "ascend"\n    "custom_attributes": {x: .nan}',
            "custom_attributes.x (node-a/ascend:0): expected a finite number, found number nan",
        ),
    }
    for old, (new, message) in cases.items():
        (err,) = [str(p) for p in parse_config(text.replace(old, new, 1), "t.yaml").devices[0].errors]
        assert message in err, err
    (err,) = fatal(text.replace('"simulated": true', '"health_interval_seconds": .inf'))
    assert err.endswith("found number inf; write a finite number")


def test_recursion_is_a_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    def deep(text: str) -> None:
        raise RecursionError

    monkeypatch.setattr("node_agent.plugins.config.compose", deep)
    assert fatal("a: 1") == ["t.yaml:1: file: expected valid YAML, found nesting too deep to read"]


def test_required_device_fields() -> None:
    for field in ("model", "hbm_memory_mb", "supported_dtypes"):
        (err,) = device_errors(with_device(**{field: DELETE}))
        assert err.startswith(f"t.yaml:8: devices[0].{field} (node-a/ascend:0): expected ")
        assert "found nothing (the key is missing)" in err


def test_bad_device_type_keeps_the_device_as_unknown() -> None:
    cfg = parse(with_device(device_type="Ascend"))
    d = cfg.devices[0]
    assert (d.device_type, d.device_id, d.model) == ("unknown", 0, "910B")
    assert [str(p) for p in d.errors] == [
        f"t.yaml:8: devices[0].device_type (node-a/unknown:0): expected one of {', '.join(DEVICE_TYPES)}, "
        "found string \"Ascend\"; write it in lowercase: 'ascend'"
    ]
    assert "did you mean 'cambricon'?" in device_errors(with_device(device_type="mlu"))[0]
    assert "did you mean 'nvidia'?" in device_errors(with_device(device_type="nvida"))[0]


def test_unreadable_ids_still_give_a_device() -> None:
    cfg = parse(with_device(device_id="zero"))
    d = cfg.devices[0]
    assert (d.device_type, d.device_id) == ("ascend", 0) and not d.ok
    assert 'devices[0].device_id (node-a/ascend:0): expected an integer >= 0, found string "zero"' in str(
        d.errors[0]
    )
    # the fallback id never collides with a declared one
    data = with_device(device_id="x")
    data["devices"][1].update(device_type="ascend", device_id=0)
    assert [(d.device_type, d.device_id, d.ok) for d in parse(data).devices] == [
        ("ascend", 1, False),
        ("ascend", 0, True),
    ]
    (err,) = device_errors(with_device(device_id=DELETE))
    assert (
        "expected device_id (one device) or device_ids (a group of identical devices), found neither" in err
    )
    err = device_errors(with_device(device_ids=[0]))[0]
    assert "expected either device_id (one device) or device_ids (a group), not both, found both" in err
    (err,) = device_errors(with_device(device_id=DELETE, device_ids=3))
    assert "found integer 3; for one device write device_id: 3" in err


def test_device_entry_that_is_not_a_mapping() -> None:
    data = base()
    data["devices"][1] = "nvidia:0"
    cfg = parse(data)
    d = cfg.devices[1]
    assert (d.device_type, d.device_id, d.ok) == ("unknown", 1, False)
    assert str(d.errors[0]).startswith(
        "t.yaml:6: devices[1] (node-a/unknown:1): expected a mapping of device fields (device_type, device_id, "
        'model...), found string "nvidia:0"'
    )
    assert cfg.devices[0].topology_distance == (0, 5) and cfg.devices[0].ok


def test_group_problem_is_shared_by_the_group() -> None:
    data = with_device(
        device_id=DELETE, device_ids=[0, 1], hbm_memory_mb="x", topology_distance=[[0, 1, 5], [1, 0, 5]]
    )
    data["devices"][1]["topology_distance"] = [5, 5, 0]
    cfg = parse(data)
    assert cfg.devices[0].errors == cfg.devices[1].errors and len(cfg.problems) == 1
    assert "devices[0].hbm_memory_mb (node-a/ascend:0, node-a/ascend:1):" in str(cfg.problems[0])
    assert cfg.devices[2].ok


def test_every_problem_is_reported_at_once() -> None:
    data = base()
    data["node"]["simulated"] = "yes"
    data["bogus"] = 1
    data["devices"][0].update(hbm_memory_mb="32GB", model=1, supported_dtypes=["half"], extra=1)
    data["devices"][1].update(p2p_enabled="no", topology_distance=[1])
    errs = fatal(data)
    fields = [e.split(": ")[1] for e in errs]
    assert fields == [
        "node.simulated",
        "devices[0].model (node-a/ascend:0)",
        "devices[0].hbm_memory_mb (node-a/ascend:0)",
        "devices[0].supported_dtypes[0] (node-a/ascend:0)",
        "devices[0].extra (node-a/ascend:0)",
        "devices[1].topology_distance (node-a/nvidia:1)",
        "devices[1].p2p_enabled (node-a/nvidia:1)",
        "bogus",
    ]


# ---------------------------------------------------------------- file-level problems


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "",
            "t.yaml:1: file: expected a YAML mapping with schema_version, node and devices, found an empty document",
        ),
        (
            "- 1\n- 2\n",
            "t.yaml:1: file: expected a YAML mapping with schema_version, node and devices, found a list [1, 2]",
        ),
        ("a: [1\nb: 2\n", "t.yaml:2: file: expected valid YAML, found a YAML syntax error"),
        ("a: 1\n---\nb: 2\n", "t.yaml:2: file: expected valid YAML, found a YAML syntax error"),
        ("a:\n\t- 1\n", "indent with spaces, YAML does not allow tabs"),
        ("\x00", "t.yaml:1: file: expected valid YAML text, found a YAML error"),
        (
            "[" * 100_000,
            "t.yaml:1: file: expected valid YAML, found a YAML syntax error: found collections nested over 64",
        ),
        (
            "".join(" " * i + "a:\n" for i in range(100)),
            "t.yaml:65: file: expected valid YAML, found a YAML syntax",
        ),
        ("!!set {a, b}", "found a collection tagged tag:yaml.org,2002:set"),
    ],
)
def test_not_a_config(text: str, expected: str) -> None:
    (err,) = fatal(text)
    assert err.startswith(expected) or expected in err, err


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            lambda d: d.pop("schema_version"),
            "t.yaml:1: schema_version: expected 1, found nothing (the key is missing)",
        ),
        (
            lambda d: d.update(schema_version=2),
            "schema_version: expected 1, found integer 2; this agent reads version 1",
        ),
        (lambda d: d.update(schema_version="1"), 'schema_version: expected 1, found string "1"'),
        (
            lambda d: d.update(version=1),
            "t.yaml:21: version: expected a known key, found unknown key 'version'; did you mean 'schema_version'?",
        ),
        (lambda d: d.pop("node"), "t.yaml:1: node: expected a mapping with name, address..., found nothing"),
        (
            lambda d: d.update(node="node-a"),
            'node: expected a mapping with name, address..., found string "node-a"',
        ),
        (
            lambda d: d["node"].pop("name"),
            "t.yaml:3: node.name: expected a string, found nothing (the key is missing); add name: node-a",
        ),
        (
            lambda d: d["node"].update(name="Node-A"),
            'node.name: expected a node name (DNS label), found string "Node-A"; write it in lowercase: node-a',
        ),
        (
            lambda d: d["node"].update(name="node_a"),
            "a DNS label: lowercase letters, digits and '-', at most 63 characters",
        ),
        (
            lambda d: d["node"].update(address="not an address"),
            "node.address: expected an IP address or a hostname",
        ),
        (
            lambda d: d["node"].update(address=""),
            "node.address: expected a non-empty string, found an empty string",
        ),
        (
            lambda d: d["node"].update(adress="x"),
            "node.adress: expected a known key, found unknown key 'adress'; did you mean 'address'?",
        ),
        (
            lambda d: d["node"].update(health_interval_seconds=0),
            "node.health_interval_seconds: expected a number > 0 and <= 60 (seconds), found integer 0",
        ),
        (lambda d: d["node"].update(health_interval_seconds=61), "found integer 61"),
        (
            lambda d: d["node"].update(health_interval_seconds="1s"),
            "write the number of seconds without the unit, e.g. 1",
        ),
        (
            lambda d: d["node"].update(simulator_state=""),
            "node.simulator_state: expected a non-empty string or null",
        ),
        (
            lambda d: d["node"].update(plugin_socket_dir=5),
            "plugin_socket_dir: expected a non-empty string or null, found integer 5; quote it",
        ),
        (
            lambda d: d.pop("devices"),
            "t.yaml:1: devices: expected a non-empty list of devices, found nothing",
        ),
        (
            lambda d: d.update(devices=[]),
            "devices: expected a non-empty list of devices, found an empty list",
        ),
        (lambda d: d.update(devices=None), "devices: expected a non-empty list of devices, found null"),
        (
            lambda d: d["devices"][1].update(device_type="ascend", device_id=0),
            "t.yaml:15: devices[1].device_id: expected a device id not declared before, found ascend 0 again "
            "(first on line 8); each (device_type, device_id) pair must be unique on a node",
        ),
        (
            lambda d: d["devices"][0].update(device_ids=[4, 4], device_id=DELETE),
            "devices[0].device_ids[1]: expected a device id not declared before, found ascend 4 again",
        ),
    ],
)
def test_file_level_problems(change: Callable[[dict[str, Json]], Any], expected: str) -> None:
    data = base()
    change(data)
    for dev in data.get("devices") or []:
        if isinstance(dev, dict) and dev.get("device_id") is DELETE:
            del dev["device_id"]
    errs = fatal(data)
    assert any(e.startswith(expected) or expected in e for e in errs), errs


def test_file_level_problem_lists_device_problems_too() -> None:
    data = base()
    data["node"]["name"] = "-bad-"
    data["devices"][1]["hbm_memory_mb"] = "x"
    errs = fatal(data)
    assert (
        len(errs) == 2 and "node.name" in errs[0] and "devices[1].hbm_memory_mb (-bad-/nvidia:1)" in errs[1]
    )


def test_duplicate_keys() -> None:
    text = dump(base()).replace('"simulated": true', '"simulated": true\n  "simulated": false')
    (err,) = fatal(text)
    assert (
        err
        == "t.yaml:6: node.simulated: expected each key once, found 'simulated' again (first on line 5); remove one of them"
    )
    text = dump(base()).replace('"model": "910B"', '"model": "910B"\n    "model": "910C"')
    (err,) = [str(p) for p in parse_config(text, "t.yaml").problems]
    assert "devices[0].model (node-a/ascend:0): expected each key once" in err


def test_too_many_devices() -> None:
    data = with_device(device_id=DELETE, device_ids=list(range(MAX_DEVICES + 1)), topology_distance=DELETE)
    (err,) = fatal(data)
    assert (
        err
        == f"t.yaml:8: devices: expected at most {MAX_DEVICES} devices on a node, found more than {MAX_DEVICES}"
    )


def test_hostile_yaml_does_not_hang() -> None:
    laughs = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(9)
    )
    errs = fatal(laughs + "devices: *j\n")
    assert len(errs) < 30 and all(len(e) < 2000 for e in errs)
    cyclic = "schema_version: 1\nnode: &n {name: node-a, address: x, simulated: *n}\ndevices: &d [*d]\n"
    errs = fatal(cyclic)
    assert any("node.simulated" in e for e in errs) and any("devices[0]" in e for e in errs)


# ---------------------------------------------------------------- files


def test_load_config_file_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigFileError) as info:
        load_config(missing)
    assert str(info.value) == (
        f"{missing}:1: file: expected a device-plugin config file, found no such file; "
        "create it (examples in deploy/examples/) or give the agent the right path"
    )
    assert isinstance(info.value, ConfigError) and isinstance(info.value, PermanentError)
    with pytest.raises(ConfigFileError, match="expected a readable file, found it cannot be read"):
        load_config(tmp_path)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"schema_version: 1\n\xff\n")
    with pytest.raises(ConfigFileError, match=r"bin.yaml:2: file: expected UTF-8 text, found byte 0xff"):
        load_config(binary)
    huge = tmp_path / "huge.yaml"
    huge.write_bytes(b"#" * (2 << 20))
    with pytest.raises(ConfigFileError, match="expected a config file of at most 1 MiB"):
        load_config(huge)
    with_bom = tmp_path / "bom.yaml"
    with_bom.write_bytes(b"\xef\xbb\xbf" + dump(base()).encode())
    assert load_config(str(with_bom)).node_name == "node-a"


def test_problem_rendering() -> None:
    assert str(Problem("f", 3, "x", "a", "b")) == "f:3: x: expected a, found b"
    assert str(Problem("f", 3, "x", "a", "b", "c")) == "f:3: x: expected a, found b; c"


# ---------------------------------------------------------------- the JSON Schema and the loader agree


def resolve(node: Json) -> dict[str, Json]:
    """A schema node with its local $ref followed (siblings of $ref win)."""
    while isinstance(node, dict) and "$ref" in node:
        target: Json = SCHEMA
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    assert isinstance(node, dict)
    return node


def types_of(node: Json) -> set[str]:
    t = resolve(node).get("type", [])
    return set(t) if isinstance(t, list) else {t}


def same(a: Json, b: Json) -> bool:
    """JSON equality: true is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def is_type(value: Json, t: str) -> bool:
    checks: dict[str, Callable[[Json], bool]] = {
        "null": lambda v: v is None,
        "boolean": lambda v: isinstance(v, bool),
        "integer": lambda v: (
            (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())
        ),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "string": lambda v: isinstance(v, str),
        "array": lambda v: isinstance(v, list),
        "object": lambda v: isinstance(v, dict),
    }
    return checks[t](value)


def validate(schema: Json, value: Json, where: str = "$") -> list[str]:
    """The subset of JSON Schema 2020-12 the shipped schema uses (formats are annotations)."""
    s = resolve(schema)
    errs: list[str] = []
    if "type" in s and not any(is_type(value, t) for t in types_of(s)):
        return [f"{where}: type"]
    if "enum" in s and not any(same(value, e) for e in s["enum"]):
        errs.append(f"{where}: enum")
    if is_type(value, "number"):
        if "minimum" in s and value < s["minimum"]:
            errs.append(f"{where}: minimum")
        if "exclusiveMinimum" in s and value <= s["exclusiveMinimum"]:
            errs.append(f"{where}: exclusiveMinimum")
        if "maximum" in s and value > s["maximum"]:
            errs.append(f"{where}: maximum")
    if isinstance(value, str):
        if len(value) < s.get("minLength", 0):
            errs.append(f"{where}: minLength")
        if "pattern" in s and not re.search(s["pattern"].replace("$", r"\Z"), value):  # ECMA-262 '$'
            errs.append(f"{where}: pattern")
    if isinstance(value, list):
        if len(value) < s.get("minItems", 0):
            errs.append(f"{where}: minItems")
        if s.get("uniqueItems") and any(same(a, b) for i, a in enumerate(value) for b in value[i + 1 :]):
            errs.append(f"{where}: uniqueItems")
        for i, item in enumerate(value):
            errs += validate(s["items"], item, f"{where}[{i}]") if "items" in s else []
    if isinstance(value, dict):
        errs += [f"{where}.{k}: required" for k in s.get("required", []) if k not in value]
        props = s.get("properties", {})
        for k, v in value.items():
            if k in props:
                errs += validate(props[k], v, f"{where}.{k}")
            elif s.get("additionalProperties") is False:
                errs.append(f"{where}.{k}: additionalProperties")
            elif isinstance(s.get("additionalProperties"), dict):
                errs += validate(s["additionalProperties"], v, f"{where}.{k}")
    if "oneOf" in s and sum(not validate(b, value, where) for b in s["oneOf"]) != 1:
        errs.append(f"{where}: oneOf")
    if "if" in s:
        branch = "then" if not validate(s["if"], value, where) else "else"
        errs += validate(s[branch], value, where) if branch in s else []
    return errs


SECTIONS: dict[str, tuple[dict[str, Json], tuple[FieldSpec, ...], str]] = {
    "root": (SCHEMA, ROOT_FIELDS, ""),
    "node": (resolve(SCHEMA["properties"]["node"]), NODE_FIELDS, "node."),
    "device": (resolve(SCHEMA["properties"]["devices"]["items"]), DEVICE_FIELDS, "devices[0]."),
}
SCHEMA_PROPERTIES = [(section, name) for section, (s, _, _) in SECTIONS.items() for name in s["properties"]]
ATTR = {"name": "node_name", **{f"{t}_compute_power_tflops": f"{t}_tflops" for t in ("fp16", "bf16", "int8")}}


@pytest.mark.parametrize("section", SECTIONS)
def test_schema_and_field_table_agree(section: str) -> None:
    schema, specs, _ = SECTIONS[section]
    assert schema["additionalProperties"] is False
    assert list(schema["properties"]) == [s.name for s in specs]
    assert set(schema["required"]) == {s.name for s in specs if s.required}
    for spec in specs:
        prop = resolve(schema["properties"][spec.name])
        assert types_of(prop) == {spec.type} | ({"null"} if spec.nullable else set()), spec.name
        assert tuple(prop.get("enum", ())) == spec.enum, spec.name
        for key, value in [
            ("minimum", spec.minimum),
            ("exclusiveMinimum", spec.exclusive_minimum),
            ("maximum", spec.maximum),
            ("pattern", spec.pattern),
            ("minLength", spec.min_length),
            ("minItems", spec.min_items),
        ]:
            assert prop.get(key) == value, (spec.name, key)
        assert prop.get("uniqueItems", False) == spec.unique_items, spec.name
        assert ("default" in prop) == (spec.default is not NO_DEFAULT), spec.name
        if "default" in prop:
            assert same(prop["default"], spec.default), spec.name
        if spec.type == "array" and spec.items:
            item = resolve(prop["items"])
            assert types_of(item) == {spec.items}, spec.name
            assert tuple(item.get("enum", ())) == spec.item_enum, spec.name
        if spec.type == "object" and spec.name == "custom_attributes":
            assert types_of(prop["additionalProperties"]) == set(ATTRIBUTE_TYPES)


def test_schema_constants_agree() -> None:
    device = SECTIONS["device"][0]
    assert [b["required"] for b in device["oneOf"]] == [[name] for name in DEVICE_ONE_OF]
    assert device["properties"]["device_type"]["enum"] == list(DEVICE_TYPES)
    assert device["properties"]["supported_dtypes"]["items"]["enum"] == list(DTYPES)
    assert SECTIONS["node"][0]["properties"]["name"]["pattern"] == NODE_NAME_RE.pattern
    for ref, spec in (("deviceId", DEVICE_ID), ("distance", DISTANCE)):
        s = SCHEMA["$defs"][ref]
        assert (s["type"], s["minimum"], s["maximum"]) == (spec.type, spec.minimum, spec.maximum)
    assert resolve(device["properties"]["device_ids"]["items"]) == SCHEMA["$defs"]["deviceId"]
    assert resolve(device["else"]["properties"]["topology_distance"])["items"] == {"$ref": "#/$defs/distance"}
    assert device["then"]["properties"]["topology_distance"]["items"] == {"$ref": "#/$defs/row"}


def put(data: dict[str, Json], section: str, name: str, value: Json) -> None:
    target = {"root": data, "node": data["node"], "device": data["devices"][0]}[section]
    if value is DELETE:
        target.pop(name, None)
    else:
        target[name] = value
    if section == "device" and name == "device_ids" and value is not DELETE:
        target.pop("device_id", None)
        target["topology_distance"] = [target["topology_distance"]]


def wrong_values(prop: dict[str, Json]) -> Iterator[Json]:
    """Values the schema refuses for this property, derived from the schema alone."""
    types = types_of(prop)
    yield from [v for v in ("x", 1.5, True, 7, None, [1], {"k": 1}) if not any(is_type(v, t) for t in types)]
    if "enum" in prop:
        yield "bogus" if "string" in types else 99
    if "minimum" in prop:
        yield prop["minimum"] - 1
    if "exclusiveMinimum" in prop:
        yield prop["exclusiveMinimum"]
    if "maximum" in prop:
        yield prop["maximum"] + 1
    if prop.get("minLength"):
        yield ""
    if "pattern" in prop:
        yield "Not_A_Label!"
    if prop.get("minItems"):
        yield []
    if prop.get("uniqueItems"):
        item = resolve(prop["items"])
        yield [item["enum"][0]] * 2 if "enum" in item else [1, 1]


@pytest.mark.parametrize(("section", "name"), SCHEMA_PROPERTIES)
def test_loader_refuses_what_the_schema_refuses(section: str, name: str) -> None:
    schema, _, prefix = SECTIONS[section]
    prop = resolve(schema["properties"][name])
    cases = list(wrong_values(prop))
    if name in schema.get("required", []) or name == "device_id":
        cases.append(DELETE)
    assert cases
    for value in cases:
        data = base()
        put(data, section, name, value)
        fields = [p.field for p in problems(data)]
        assert any(f.startswith(prefix + name) for f in fields), (name, value, fields)
        if value is not DELETE:
            assert validate(SCHEMA, data) != [], (name, value)


@pytest.mark.parametrize(("section", "name"), SCHEMA_PROPERTIES)
def test_loader_accepts_what_the_schema_allows(section: str, name: str) -> None:
    schema, _, _ = SECTIONS[section]
    prop = resolve(schema["properties"][name])
    values = [*prop.get("enum", ())]
    if "default" in prop:
        values.append(prop["default"])
    values += [prop[k] for k in ("minimum", "maximum") if k in prop]
    if "exclusiveMinimum" in prop:
        values.append(prop["exclusiveMinimum"] + 0.001)
    for value in values:
        data = base()
        put(data, section, name, value)
        if name == "total_memory_mb" and isinstance(value, int) and value < 32768:
            data["devices"][0]["hbm_memory_mb"] = value
        assert validate(SCHEMA, data) == [], (name, value)
        assert problems(data) == [], (name, value)
    if "default" in prop and section != "root":
        data = base()
        put(data, section, name, DELETE)
        cfg = parse(data)
        obj: Any = cfg if section == "node" else cfg.devices[0]
        loaded = getattr(obj, ATTR.get(name, name))
        assert same(loaded, prop["default"]) or loaded == prop["default"], name


# ---------------------------------------------------------------- random input (hypothesis)

FAST = settings(
    max_examples=250,
    deadline=timedelta(seconds=1),
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**65), 2**65)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(["fp16", "ascend", "910B", "32GB", "yes", "0x1F", "1e3", "node-a", "-1", "~"])
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


def similar(value: Json) -> st.SearchStrategy[Json]:
    """Values of the same JSON type as `value`, so that the loader accepts some of the mutations."""
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.integers(-2, 70000) | st.sampled_from([0, 1, 2**31, 2**63])
    if isinstance(value, float):
        return st.floats(-1, 100)
    if isinstance(value, str):
        words = [*DEVICE_TYPES, *DTYPES, "node-b", "10.0.0.2", "gpu-1.local", "K100", "a b", "Node"]
        return st.sampled_from(words) | st.text(max_size=6)
    if isinstance(value, list):
        return st.lists(similar(value[0]) if value else scalars, max_size=len(value) + 1)
    return json_values


def loader_only(p: Problem) -> bool:
    """Problems the JSON Schema cannot express (see its top-level description)."""
    return (
        "topology_distance" in p.field
        or str(p.expected).startswith(("a device id not declared", "total_memory_mb >=", "an IP address"))
        or str(p.hint).startswith("write a whole number")  # JSON Schema counts 5.0 as an integer
    )


def to_data(node: Node | None, depth: int = 0) -> Json:
    """The YAML 1.2 data of a node tree, as the loader reads it."""
    assert depth < 50
    if isinstance(node, ScalarNode):
        return scalar_value(node)
    if isinstance(node, MappingNode):
        return {to_data(k, depth + 1): to_data(v, depth + 1) for k, v in node.value}
    assert isinstance(node, SequenceNode)
    return [to_data(v, depth + 1) for v in node.value]


def paths(data: Json, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(data, dict):
        for k, v in data.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from paths(v, (*prefix, i))


def check_invariants(cfg: NodeConfig) -> None:
    n = len(cfg.devices)
    names = [cfg.device_name(d) for d in cfg.devices]
    assert n >= 1 and len(set(names)) == n
    for d in cfg.devices:
        assert all(isinstance(p, Problem) for p in d.errors)
        assert len(d.topology_distance) in (0, n)
        assert d.device_type in (*DEVICE_TYPES, "unknown") and d.device_id >= 0
        if d.ok:
            assert d.device_type != "unknown" and d.supported_dtypes and d.hbm_memory_mb >= 1
            assert d.topology_distance[names.index(cfg.device_name(d))] == 0


def load_anything(text: str) -> NodeConfig | None:
    try:
        cfg = parse_config(text, "h.yaml")
    except ConfigFileError as e:
        assert e.problems and all(isinstance(p, Problem) for p in e.problems)
        return None
    check_invariants(cfg)
    return cfg


@pytest.mark.timeout(60)
@FAST
@given(
    st.text(
        alphabet=st.sampled_from(list("abn01-_:[]{},&*!|>'\"#%@ \n\t.~?")) | st.characters(), max_size=200
    )
)
def test_random_text_never_raises_anything_else(text: str) -> None:
    load_anything(text)


@pytest.mark.timeout(60)
@FAST
@given(
    st.sampled_from([*VENDOR_EXAMPLES, "node-a", "node-b"]),
    st.lists(
        st.tuples(st.integers(0, 4000), st.integers(0, 40), st.text(max_size=6)), min_size=1, max_size=4
    ),
)
def test_mutated_example_text_never_raises_anything_else(
    name: str, edits: list[tuple[int, int, str]]
) -> None:
    text = (EXAMPLES / f"{name}.yaml").read_text()
    for at, cut, insert in edits:
        at %= len(text) + 1
        text = text[:at] + insert + text[at + cut :]
    cfg = load_anything(text)
    if cfg is not None and not cfg.problems:
        assert validate(SCHEMA, to_data(compose(text))) == [], "the loader accepted what the schema refuses"


def _maybe(strategy: st.SearchStrategy[Json]) -> st.SearchStrategy[Json]:
    return st.just(DELETE) | st.just(DELETE) | strategy  # two thirds of optional fields absent


_text = st.text(min_size=1, max_size=8)
_attribute = (
    st.text(max_size=5) | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.booleans()
)
NODE_VALUES: dict[str, st.SearchStrategy[Json]] = {
    "name": st.from_regex(NODE_NAME_RE, fullmatch=True).filter(lambda x: "\n" not in x),
    "address": st.sampled_from(["127.0.0.1", "10.1.2.3", "::1", "gpu-7", "a.b-c.local"]),
    "simulated": _maybe(st.booleans()),
    "simulator_state": _maybe(st.none() | _text),
    "health_interval_seconds": _maybe(st.floats(0.001, 60) | st.integers(1, 60)),
    "plugin_socket_dir": _maybe(st.none() | _text),
}
DEVICE_VALUES: dict[str, st.SearchStrategy[Json]] = {
    "model": _text,
    "p2p_enabled": _maybe(st.booleans()),
    "p2p_bandwidth_gbps": _maybe(st.floats(0, 1e4) | st.integers(0, 900)),
    "hbm_memory_mb": st.integers(1, 2**40),
    "total_memory_mb": _maybe(st.integers(0, 4096)),  # added to hbm_memory_mb
    "sys_memory_mb": _maybe(st.integers(0, 2**20)),
    "fp16_compute_power_tflops": _maybe(st.floats(0, 1e4)),
    "bf16_compute_power_tflops": _maybe(st.integers(0, 1000)),
    "int8_compute_power_tflops": _maybe(st.floats(0, 1e4)),
    "supported_dtypes": st.lists(st.sampled_from(DTYPES), min_size=1, max_size=4, unique=True),
    "custom_attributes": _maybe(st.dictionaries(st.text(max_size=5), _attribute, max_size=3)),
}
_small = st.integers(0, 3)
_distance = st.integers(0, 20)


@st.composite
def valid_configs(draw: st.DrawFn) -> dict[str, Json]:
    """Configs written by the rules of the format, over 1-4 entries of 1-3 devices."""
    node = {k: v for k, s in NODE_VALUES.items() if (v := draw(s)) is not DELETE}
    next_id = dict.fromkeys(DEVICE_TYPES, 0)
    devices: list[dict[str, Json]] = []
    for _ in range(draw(st.integers(1, 4))):
        vendor = draw(st.sampled_from(DEVICE_TYPES))
        group = draw(st.booleans())
        ids = []
        for _ in range(draw(st.integers(1, 3)) if group else 1):
            next_id[vendor] += draw(_small)
            ids.append(next_id[vendor])
            next_id[vendor] += 1
        entry: dict[str, Json] = {
            "device_type": vendor,
            **({"device_ids": ids} if group else {"device_id": ids[0]}),
        }
        entry.update({k: v for k, s in DEVICE_VALUES.items() if (v := draw(s)) is not DELETE})
        if "total_memory_mb" in entry:
            entry["total_memory_mb"] += entry["hbm_memory_mb"]
        devices.append(entry)
    n = sum(len(d.get("device_ids", [0])) for d in devices)
    matrix = [[0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            matrix[i][j] = matrix[j][i] = draw(_distance)
    position = 0
    for d in devices:
        count = len(d.get("device_ids", [0]))
        rows = matrix[position : position + count]
        position += count
        if n > 1 or draw(st.booleans()):
            d["topology_distance"] = rows if "device_ids" in d else rows[0]
    return {"schema_version": 1, "node": node, "devices": devices}


@pytest.mark.timeout(60)
@FAST
@given(valid_configs())
def test_valid_configs_load_exactly(config: dict[str, Json]) -> None:
    assert validate(SCHEMA, config) == []
    cfg = parse(config)
    assert cfg.problems == ()
    node = config["node"]
    assert (cfg.node_name, cfg.address) == (node["name"], node["address"])
    assert cfg.simulated is node.get("simulated", False)
    assert cfg.health_interval_seconds == node.get("health_interval_seconds", 1.0)
    assert cfg.simulator_state == node.get("simulator_state")
    declared = [(d, i) for d in config["devices"] for i in d.get("device_ids", [d.get("device_id")])]
    assert len(cfg.devices) == len(declared)
    for k, (got, (entry, device_id)) in enumerate(zip(cfg.devices, declared, strict=True)):
        assert (got.device_type, got.device_id, got.model) == (
            entry["device_type"],
            device_id,
            entry["model"],
        )
        assert (got.hbm_memory_mb, got.total_memory_mb) == (
            entry["hbm_memory_mb"],
            entry.get("total_memory_mb", entry["hbm_memory_mb"]),
        )
        assert got.supported_dtypes == tuple(entry["supported_dtypes"])
        assert got.custom_attributes == entry.get("custom_attributes", {})
        assert got.fp16_tflops == entry.get("fp16_compute_power_tflops", 0)
        assert len(got.topology_distance) == len(declared) and got.topology_distance[k] == 0


@pytest.mark.timeout(60)
@FAST
@given(valid_configs(), st.data())
def test_mutated_values_never_raise_and_stay_with_their_device(
    config: dict[str, Json], data: st.DataObject
) -> None:
    path = data.draw(st.sampled_from(list(paths(config))[1:]))
    mutated = copy.deepcopy(config)
    target: Any = mutated
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = data.draw(similar(target[path[-1]]) | json_values)
    cfg = load_anything(dump(mutated))
    if len(path) >= 3 and path[0] == "devices" and path[2] not in IDENTITY:
        # a bad device field never invalidates the file, nor another entry's device
        assert cfg is not None
        counts = [len(d.get("device_ids", [0])) for d in config["devices"]]
        first = sum(counts[: path[1]])
        others = cfg.devices[:first] + cfg.devices[first + counts[path[1]] :]
        assert all(d.ok for d in others), [p for d in others for p in d.errors]
    schema_errors = validate(SCHEMA, mutated)
    if cfg is not None and not cfg.problems:
        assert schema_errors == [], "the loader accepted what the schema refuses"
    if not schema_errors:
        refused = problems(mutated)
        assert all(loader_only(p) for p in refused), ("the schema accepts what the loader refuses", refused)


IDENTITY = ("device_type", "device_id", "device_ids", "topology_distance")
