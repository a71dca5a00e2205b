"""Strict loader of `device-plugin-config.yaml`, the one file that tells a node agent what it serves.

The file (JSON Schema: device-plugin-config.schema.json next to this module; examples: deploy/examples/)::

    schema_version: 1
    node:
      name: node-a                  # DNS label, must match the agent's certificate
      address: 127.0.0.1            # where instances serve (IP or hostname)
      simulated: false              # stand-in vendor tools instead of real ones
      simulator_state: null         # optional state file of the stand-in tools
      health_interval_seconds: 1.0  # > 0, <= 60
      plugin_socket_dir: null       # optional dir of out-of-process plugin sockets
    devices:
      - device_type: ascend         # ascend | cambricon | hygon | nvidia
        device_id: 0                # one device, or `device_ids: [1, 2, 3]` for identical ones
        model: 910B
        hbm_memory_mb: 32768
        supported_dtypes: [fp16, bf16, int8]
        topology_distance: [0, 1, 2, 2]   # a group gives one row per device
        # optional: total_memory_mb (= hbm), sys_memory_mb, p2p_enabled, p2p_bandwidth_gbps,
        # fp16/bf16/int8_compute_power_tflops, custom_attributes (string -> scalar)

Devices, groups expanded, are numbered in declaration order; the rows form an N x N matrix (zero
diagonal, symmetric) over every device of the node, all vendors together.

The whole file is checked and every problem reported at once, as `FILE:LINE: FIELD: expected X, found Y;
HINT`. Problems of the file or of the node section make it unusable: `load_config` raises
`ConfigFileError` listing all of them. A problem inside one device entry does not: that device comes back
with `errors` set (the agent reports it as Error) and the others serve. Values are read as YAML 1.2
(what editors do): `yes`, `"true"` or `"32GB"` are strings, never booleans or numbers.
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass, field

import yaml

from kunlun_common.errors import ConfigError
from kunlun_common.messages import Message, msg, msg_list
from kunlun_common.names import device_name
from node_agent.plugins.config_devices import Built, Entry, empty_list, expand, read_entry
from node_agent.plugins.config_schema import (
    MAX_DEVICES,
    MAX_FILE_BYTES,
    NODE_FIELDS,
    ROOT_FIELDS,
    SCHEMA_VERSION,
    Fault,
    Issue,
    Problem,
    Text,
    check_number,
    check_scalar,
    read_keys,
)
from node_agent.plugins.config_yaml import (
    Node,
    ScalarNode,
    compose,
    describe,
    is_mapping,
    is_sequence,
    line_of,
    scalar_value,
)

__all__ = [
    "ConfigFileError",
    "DeviceDecl",
    "NodeConfig",
    "Problem",
    "load_config",
    "parse_config",
    "schema_path",
]

AttributeValue = str | int | float | bool


@dataclass(frozen=True)
class DeviceDecl:
    """One declared device. `errors` is empty when the declaration is correct."""

    device_type: str
    device_id: int
    model: str
    p2p_enabled: bool
    p2p_bandwidth_gbps: float
    topology_distance: tuple[int, ...]  # this device's row (empty tuple if unknown)
    total_memory_mb: int
    hbm_memory_mb: int
    sys_memory_mb: int
    fp16_tflops: float
    bf16_tflops: float
    int8_tflops: float
    supported_dtypes: tuple[str, ...]
    custom_attributes: dict[str, AttributeValue]
    line: int
    errors: tuple[Problem, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.errors


@dataclass(frozen=True)
class NodeConfig:
    """A loaded config: the node section and every declared device, in declaration order."""

    path: str
    node_name: str
    address: str
    simulated: bool
    simulator_state: str | None
    health_interval_seconds: float
    plugin_socket_dir: str | None
    devices: tuple[DeviceDecl, ...] = field(default=())

    def device_name(self, d: DeviceDecl) -> str:
        """The canonical `<node>/<type>:<id>` name of one of this node's devices."""
        return device_name(self.node_name, d.device_type, d.device_id)

    @property
    def problems(self) -> tuple[Problem, ...]:
        """Every device-level problem, in file order (a loaded config has no file-level ones)."""
        return tuple(sorted(dict.fromkeys(p for d in self.devices for p in d.errors), key=lambda p: p.line))


class ConfigFileError(ConfigError):
    """The file cannot be used at all; `problems` lists everything wrong in it, one per line in str()."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = sorted(dict.fromkeys(problems), key=lambda p: p.line)  # a group shares problems
        super().__init__(
            msg_list("config.problems", "{parts}", [p.message() for p in self.problems], bullet="")
        )


def schema_path() -> pathlib.Path:
    """The JSON Schema of the file, shipped with the package (for editors and `yaml-language-server`)."""
    return pathlib.Path(__file__).with_name("device-plugin-config.schema.json")


def load_config(path: str | os.PathLike[str]) -> NodeConfig:
    """Read and check a device-plugin config file; raise ConfigFileError if it cannot be used."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        expected = msg("config.expected.config_file", "a device-plugin config file")
        fix = msg(
            "config.hint.create", "create it (examples in deploy/examples/) or give the agent the right path"
        )
        found = msg("config.found.no_such_file", "no such file")
        raise ConfigFileError([Problem(name, 1, "file", expected, found, fix)]) from None
    except OSError as e:
        found = msg("config.found.unreadable", "it cannot be read ({reason})", reason=e.strerror or str(e))
        hint = msg(
            "config.hint.readable",
            "make it a readable file for the agent's user, or give the agent the right path",
        )
        expected = msg("config.expected.readable", "a readable file")
        raise ConfigFileError([Problem(name, 1, "file", expected, found, hint)]) from None
    if len(data) > MAX_FILE_BYTES:
        found = msg("config.found.too_many_bytes", "more than {max} bytes", max=MAX_FILE_BYTES)
        raise ConfigFileError([Problem(name, 1, "file", _at_most_1mib(), found)])
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        expected = msg("config.expected.utf8", "UTF-8 text")
        found = msg("config.found.byte", "byte {byte}", byte=f"{data[e.start]:#04x}")
        raise ConfigFileError([Problem(name, line, "file", expected, found)]) from None
    return parse_config(text, name)


def parse_config(text: str, path: str = "<string>") -> NodeConfig:
    """Check a config given as text; `path` only names it in problems. Raises ConfigFileError."""
    return _Loader(path).load(text)


class _Loader:
    def __init__(self, path: str) -> None:
        self.path = path
        self.fatal: list[Problem] = []  # file-level problems
        self.node_label = "<node>"  # the node's name in device names, even if it is invalid

    def fail(self, line: int, field_name: str, fault: Fault) -> None:
        self.fatal.append(Problem(self.path, line, field_name, *fault))

    def issues(self, issues: list[Issue], prefix: str) -> None:
        for i in issues:
            self.fail(i.line, prefix + i.field, i.fault)

    def load(self, text: str) -> NodeConfig:
        if len(text) > MAX_FILE_BYTES:
            found = msg("config.found.characters", "{count} characters", count=len(text))
            self.fail(1, "file", Fault(_at_most_1mib(), found))
            raise ConfigFileError(self.fatal)
        root = self._compose(text)
        if root is None:
            raise ConfigFileError(self.fatal)
        keys, issues = read_keys(root, ROOT_FIELDS)
        self.issues(issues, "")
        version_node = keys.get("schema_version")
        version = check_number(ROOT_FIELDS[0], version_node)
        if isinstance(version, Fault) or version != SCHEMA_VERSION:
            hint = msg(
                "config.hint.schema_version",
                "this agent reads version 1 only; write schema_version: 1 as the first line",
            )
            found = describe(version_node)
            self.fail(
                line_of(version_node or root), "schema_version", Fault(str(SCHEMA_VERSION), found, hint)
            )
        node = self._node(keys.get("node"), root)
        entries = self._entries(keys.get("devices"), root)
        name = node["name"]
        built, duplicates = expand(entries, self.node_label, self.path)
        self.fatal.extend(duplicates)
        devices = tuple(_decl(b) for b in built)
        if self.fatal:
            raise ConfigFileError(self.fatal + [p for d in devices for p in d.errors])
        interval = node["health_interval_seconds"]
        return NodeConfig(
            path=self.path,
            node_name=str(name),
            address=str(node["address"]),
            simulated=node["simulated"] is True,
            simulator_state=_opt_str(node["simulator_state"]),
            health_interval_seconds=float(interval) if isinstance(interval, int | float) else 1.0,
            plugin_socket_dir=_opt_str(node["plugin_socket_dir"]),
            devices=devices,
        )

    def _compose(self, text: str) -> Node | None:
        expected = msg("config.expected.root", "a YAML mapping with schema_version, node and devices")
        valid = msg("config.expected.valid_yaml", "valid YAML")
        try:
            root = compose(text)
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            line = int(mark.line) + 1 if mark is not None else 1
            what = " ".join(str(x) for x in (e.context, e.problem) if x)
            found = msg("config.found.yaml_syntax", "a YAML syntax error: {what}", what=what)
            self.fail(line, "file", Fault(valid, found, _yaml_hint(what)))
            return None
        except yaml.YAMLError as e:
            found = msg("config.found.yaml_error", "a YAML error: {error}", error=str(e))
            self.fail(1, "file", Fault(msg("config.expected.valid_yaml_text", "valid YAML text"), found))
            return None
        except RecursionError:
            self.fail(1, "file", Fault(valid, msg("config.found.too_deep", "nesting too deep to read")))
            return None
        if root is None:
            hint = msg("config.hint.template", "see deploy/examples/ for a template")
            self.fail(
                1, "file", Fault(expected, msg("config.found.empty_document", "an empty document"), hint)
            )
            return None
        if not is_mapping(root):
            self.fail(line_of(root), "file", Fault(expected, describe(root)))
            return None
        return root

    def _node(self, section: Node | None, root: Node) -> dict[str, object]:
        values: dict[str, object] = {s.name: s.default for s in NODE_FIELDS}
        if section is None or not is_mapping(section):
            hint = msg("config.hint.add_node", "add a node: section with name and address")
            self.fail(
                line_of(section or root),
                "node",
                Fault(
                    msg("config.expected.node", "a mapping with name, address..."), describe(section), hint
                ),
            )
            return values
        keys, issues = read_keys(section, NODE_FIELDS)
        self.issues(issues, "node.")
        name = keys.get("name")
        if isinstance(name, ScalarNode) and isinstance(label := scalar_value(name), str) and label:
            self.node_label = label
        for spec in NODE_FIELDS:
            value_node = keys.get(spec.name)
            if value_node is None and not spec.required:
                continue
            value = check_scalar(spec, value_node)
            if isinstance(value, Fault):
                self.fail(line_of(value_node or section), "node." + spec.name, value)
            else:
                values[spec.name] = value
        return values

    def _entries(self, devices: Node | None, root: Node) -> list[Entry]:
        hint = msg(
            "config.hint.devices", "declare the node's accelerators under devices:, see deploy/examples/"
        )
        if devices is None or not is_sequence(devices) or not devices.value:
            found = empty_list() if is_sequence(devices) else describe(devices)
            expected = msg("config.expected.devices", "a non-empty list of devices")
            self.fail(line_of(devices or root), "devices", Fault(expected, found, hint))
            return []
        entries: list[Entry] = []
        count = 0
        for index, item in enumerate(devices.value):
            entry = read_entry(index, item)
            count += len(entry.ids)
            entries.append(entry)
            if count > MAX_DEVICES:
                found = msg("config.found.more_than", "more than {max}", max=MAX_DEVICES)
                expected = msg(
                    "config.expected.max_devices", "at most {max} devices on a node", max=MAX_DEVICES
                )
                self.fail(line_of(item), "devices", Fault(expected, found))
                return []
        return entries


def _decl(b: Built) -> DeviceDecl:
    e = b.entry
    return DeviceDecl(
        device_type=b.device_type,
        device_id=b.device_id,
        model=e.model,
        p2p_enabled=e.p2p_enabled,
        p2p_bandwidth_gbps=float(e.p2p_bandwidth_gbps),
        topology_distance=b.row,
        total_memory_mb=e.total_memory_mb,
        hbm_memory_mb=e.hbm_memory_mb,
        sys_memory_mb=e.sys_memory_mb,
        fp16_tflops=float(e.fp16_compute_power_tflops),
        bf16_tflops=float(e.bf16_compute_power_tflops),
        int8_tflops=float(e.int8_compute_power_tflops),
        supported_dtypes=e.supported_dtypes,
        custom_attributes=dict(e.custom_attributes),
        line=e.line,
        errors=tuple(sorted(b.problems, key=lambda p: p.line)),
    )


def _opt_str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _at_most_1mib() -> Message:
    return msg("config.expected.at_most_1mib", "a config file of at most 1 MiB")


def _yaml_hint(what: str) -> Text:
    if "'\\t'" in what or "tab" in what:
        return msg("config.hint.tabs", "indent with spaces, YAML does not allow tabs")
    if "nested over" in what:
        return msg("config.hint.levels", "a device-plugin config needs 5 levels at most")
    if "mapping values are not allowed" in what:
        return msg("config.hint.colon", "quote values that contain ': ', or put a space after each ':'")
    return msg("config.hint.yaml", "check indentation and quoting near that line")
