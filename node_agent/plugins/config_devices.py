"""The `devices:` section of device-plugin-config.yaml: entries, groups, ids and the topology matrix.

`read_entry` checks one list item on its own; `expand` then numbers the devices of all entries in
declaration order, gives every device a name (even a broken one: type "unknown", or a free id), checks
the N x N topology matrix and turns each issue into a Problem naming the device. Only duplicate ids are
file-level; everything else stays with the device it concerns.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from kunlun_common.messages import Message, msg
from kunlun_common.names import device_name
from node_agent.plugins.config_schema import (
    DEVICE_FIELDS,
    DEVICE_ID,
    DISTANCE,
    DTYPE_ALIASES,
    DTYPES,
    MAX_DEVICES,
    NO_DEFAULT,
    Fault,
    FieldSpec,
    Issue,
    Problem,
    Text,
    check_number,
    check_scalar,
    each_once,
    expected_text,
    read_keys,
    remove_one,
    suggest,
)
from node_agent.plugins.config_yaml import (
    Node,
    ScalarNode,
    describe,
    is_mapping,
    is_sequence,
    line_of,
    render,
    scalar_value,
)

UNKNOWN_TYPE = "unknown"
_SPECS = {s.name: s for s in DEVICE_FIELDS}
_SCALARS = [
    s
    for s in DEVICE_FIELDS
    if s.type not in ("array", "object") and s.name not in ("device_type", "device_id")
]
Row = tuple[int, ...]


@dataclass
class Entry:
    """One item of `devices:` as read, with defaults where a value is missing or wrong."""

    index: int
    line: int
    device_type: str = UNKNOWN_TYPE
    ids: list[int | None] = field(default_factory=list)  # None: unreadable
    group: bool = False  # declared with device_ids
    readable: bool = True  # a mapping (else only its position is known)
    keys: dict[str, Node] = field(default_factory=dict)
    issues: list[Issue] = field(default_factory=list)  # concern every device of the entry
    id_issues: dict[int, list[Issue]] = field(default_factory=dict)  # by position in ids
    model: str = ""
    p2p_enabled: bool = False
    p2p_bandwidth_gbps: float = 0.0
    total_memory_mb: int = 0
    hbm_memory_mb: int = 0
    sys_memory_mb: int = 0
    fp16_compute_power_tflops: float = 0.0
    bf16_compute_power_tflops: float = 0.0
    int8_compute_power_tflops: float = 0.0
    supported_dtypes: tuple[str, ...] = ()
    custom_attributes: dict[str, str | int | float | bool] = field(default_factory=dict)

    def fault(self, node: Node | None, name: str, fault: Fault) -> None:
        self.issues.append(Issue(line_of(node) if node is not None else self.line, name, fault))


@dataclass
class Built:
    """A device of an entry with its final name parts, topology row and problems."""

    entry: Entry
    device_type: str
    device_id: int
    row: Row
    problems: list[Problem]


def read_entry(index: int, node: Node) -> Entry:
    entry = Entry(index, line_of(node))
    if not is_mapping(node):
        expected = msg(
            "config.expected.device_mapping", "a mapping of device fields (device_type, device_id, model...)"
        )
        entry.fault(node, "", Fault(expected, describe(node)))
        entry.ids, entry.readable = [None], False
        return entry
    entry.keys, entry.issues = read_keys(node, DEVICE_FIELDS)
    keys = entry.keys
    device_type = _check(_SPECS["device_type"], keys.get("device_type"))
    if isinstance(device_type, Fault):
        entry.fault(keys.get("device_type"), "device_type", device_type)
    else:
        entry.device_type = str(device_type)
    _read_ids(entry)
    for spec in _SCALARS:
        value_node = keys.get(spec.name)
        if value_node is None and not spec.required:
            if spec.default is not NO_DEFAULT:
                setattr(entry, spec.name, spec.default)
            continue
        value = _check(spec, value_node)
        if isinstance(value, Fault):
            entry.fault(value_node, spec.name, value)
        else:
            setattr(entry, spec.name, value)
    total = keys.get("total_memory_mb")
    if total is None:
        entry.total_memory_mb = entry.hbm_memory_mb
    elif entry.hbm_memory_mb and 0 < entry.total_memory_mb < entry.hbm_memory_mb:
        expected = msg(
            "config.expected.total_ge_hbm",
            "total_memory_mb >= hbm_memory_mb ({hbm})",
            hbm=entry.hbm_memory_mb,
        )
        hint = msg("config.hint.total_counts_hbm", "total counts HBM too")
        entry.fault(total, "total_memory_mb", Fault(expected, str(entry.total_memory_mb), hint))
    _read_dtypes(entry, keys.get("supported_dtypes"))
    _read_attributes(entry, keys.get("custom_attributes"))
    return entry


def _check(spec: FieldSpec, node: Node | None) -> str | bool | int | float | Fault:
    value = check_scalar(spec, node)
    return (
        Fault(expected_text(spec), msg("config.found.null", "null")) if value is None else value
    )  # no device field is nullable


def _read_ids(entry: Entry) -> None:
    one, many = entry.keys.get("device_id"), entry.keys.get("device_ids")
    if one is not None and many is not None:
        expected = msg(
            "config.expected.id_or_ids", "either device_id (one device) or device_ids (a group), not both"
        )
        both = msg("config.found.both", "both")
        entry.fault(
            one,
            "device_id",
            Fault(expected, both, msg("config.hint.keep_ids", "keep device_ids and remove device_id")),
        )
    if many is not None:
        entry.group = True
        if not is_sequence(many) or not many.value:
            scalar = scalar_value(many) if isinstance(many, ScalarNode) else None
            hint = msg("config.hint.ids_list", "write a list, e.g. device_ids: [0, 1, 2, 3]")
            if isinstance(scalar, int) and not isinstance(scalar, bool):
                hint = msg("config.hint.one_device_id", "for one device write device_id: {id}", id=scalar)
            expected = msg("config.expected.ids", "a non-empty list of device ids")
            entry.fault(many, "device_ids", Fault(expected, describe(many), hint))
            # how many devices? as many as topology rows, if those are rows; the shape follows
            topo = entry.keys.get("topology_distance")
            entry.group = (
                is_sequence(topo) and topo is not None and bool(topo.value) and is_sequence(topo.value[0])
            )
            entry.ids = [None] * (min(len(topo.value), MAX_DEVICES + 1) if entry.group and topo else 1)
            return
        if len(many.value) > MAX_DEVICES:
            entry.ids = [None] * len(many.value)  # the caller refuses the file
            return
        for k, item in enumerate(many.value):
            value = check_number(DEVICE_ID, item)
            if isinstance(value, Fault):
                entry.id_issues[k] = [Issue(line_of(item), f"device_ids[{k}]", value)]
                entry.ids.append(None)
            else:
                entry.ids.append(int(value))
    elif one is not None:
        value = check_number(DEVICE_ID, one)
        if isinstance(value, Fault):
            entry.id_issues[0] = [Issue(line_of(one), "device_id", value)]
        entry.ids = [None if isinstance(value, Fault) else int(value)]
    else:
        expected = msg(
            "config.expected.id_or_group",
            "device_id (one device) or device_ids (a group of identical devices)",
        )
        hint = msg("config.hint.add", "add {field}: {value}", field="device_id", value="0")
        entry.fault(None, "device_id", Fault(expected, msg("config.found.neither", "neither"), hint))
        entry.ids = [None]


def _read_dtypes(entry: Entry, node: Node | None) -> None:
    expected = msg(
        "config.expected.dtypes", "a non-empty list of dtypes from {choices}", choices=", ".join(DTYPES)
    )
    if node is None or not is_sequence(node) or not node.value:
        value = scalar_value(node) if isinstance(node, ScalarNode) else None
        hint: Text = (
            msg("config.hint.write_list", "write a list: [{value}]", value=value)
            if isinstance(value, str)
            else msg("config.hint.dtypes_eg", "e.g. supported_dtypes: [fp16, bf16]")
        )
        entry.fault(
            node,
            "supported_dtypes",
            Fault(expected, empty_list() if is_sequence(node) else describe(node), hint),
        )
        return
    dtypes: list[str] = []
    for k, item in enumerate(node.value):
        value = scalar_value(item) if isinstance(item, ScalarNode) else None
        name = f"supported_dtypes[{k}]"
        if not isinstance(value, str) or value not in DTYPES:
            hint = suggest(value, DTYPES, DTYPE_ALIASES) if isinstance(value, str) else ""
            one_of = msg("config.expected.one_of", "one of {choices}", choices=", ".join(DTYPES))
            entry.fault(item, name, Fault(one_of, describe(item), hint))
        elif value in dtypes:
            again = msg("config.found.value_again", "{value} again", value=value)
            fault = Fault(
                msg("config.expected.dtype_once", "each dtype once"),
                again,
                msg("config.hint.remove_repeated", "remove the repeated one"),
            )
            entry.fault(item, name, fault)
        else:
            dtypes.append(value)
    entry.supported_dtypes = tuple(dtypes)


def _read_attributes(entry: Entry, node: Node | None) -> None:
    if node is None:
        return
    expected = msg("config.expected.attributes", "a mapping of names to strings, numbers or booleans")
    if not is_mapping(node):
        hint = msg("config.hint.attributes_eg", "e.g. {example}", example="{aclnn_fusion_enabled: true}")
        entry.fault(node, "custom_attributes", Fault(expected, describe(node), hint))
        return
    attributes: dict[str, str | int | float | bool] = {}
    for key_node, value_node in node.value:
        key = scalar_value(key_node) if isinstance(key_node, ScalarNode) else None
        if not isinstance(key, str):
            fault = Fault(
                msg("config.expected.string_keys", "string keys"),
                describe(key_node),
                msg("config.hint.quote_key", "quote the key"),
            )
            entry.fault(key_node, "custom_attributes", fault)
            continue
        name = f"custom_attributes.{key}"
        value = scalar_value(value_node) if isinstance(value_node, ScalarNode) else None
        if key in attributes:
            again = msg("config.found.quoted_again", "'{key}' again", key=key)
            entry.fault(key_node, name, Fault(each_once(), again, remove_one()))
        elif isinstance(value, float) and not math.isfinite(value):
            fault = Fault(
                msg("config.expected.finite", "a finite number"),
                describe(value_node),
                msg("config.hint.quote_for_string", "quote it for a string"),
            )
            entry.fault(value_node, name, fault)
        elif isinstance(value, str | int | float | bool):  # bool is an int
            attributes[key] = value
        else:
            scalar = isinstance(value_node, ScalarNode)
            hint = (
                msg("config.hint.quote_or_remove", "quote it for a string, or remove the key")
                if scalar
                else msg("config.hint.flatten", "flatten it to scalar values")
            )
            scalar_kind = msg("config.expected.scalar", "a string, number or boolean")
            entry.fault(value_node, name, Fault(scalar_kind, describe(value_node), hint))
    entry.custom_attributes = attributes


def expand(entries: list[Entry], node_name: str, path: str) -> tuple[list[Built], list[Problem]]:
    """Every device of every entry, named and with its row checked; plus the file-level id problems."""
    fatal: list[Problem] = []
    seen: dict[tuple[str, int], int] = {}  # -> line
    for e in entries:
        for k, device_id in enumerate(e.ids):
            if device_id is None or e.device_type == UNKNOWN_TYPE:
                continue
            if (e.device_type, device_id) in seen:
                where = f"devices[{e.index}]." + (f"device_ids[{k}]" if e.group else "device_id")
                found = msg(
                    "config.found.device_again",
                    "{type} {id} again (first on line {first})",
                    type=e.device_type,
                    id=device_id,
                    first=seen[(e.device_type, device_id)],
                )
                hint = msg(
                    "config.hint.unique_pair", "each (device_type, device_id) pair must be unique on a node"
                )
                expected = msg("config.expected.new_id", "a device id not declared before")
                fatal.append(Problem(path, e.line, where, expected, found, hint))
            seen.setdefault((e.device_type, device_id), e.line)
    built: list[Built] = []
    for e in entries:
        for device_id in e.ids:
            position = len(built)
            if e.device_type == UNKNOWN_TYPE:
                device_id = position
            elif device_id is None:  # the position if free, else the smallest free id
                device_id = position
                if (e.device_type, device_id) in seen:
                    device_id = next(i for i in itertools.count() if (e.device_type, i) not in seen)
                seen[(e.device_type, device_id)] = e.line
            built.append(Built(e, e.device_type, device_id, (), []))
    names = [device_name(node_name, b.device_type, b.device_id) for b in built]
    n = len(built)
    own: list[list[Issue]] = []  # per device
    rows: list[Row | None] = []
    row_fields: list[str] = []
    lines: list[int] = []
    for e in entries:
        first = len(rows)
        shared, per_device = _rows(e, n)
        label = ", ".join(names[first : first + len(e.ids)])  # a shared problem names the whole group
        problems = [_problem(path, e.index, i, label) for i in [*e.issues, *shared]]
        for k, (row, issues, row_field, line) in enumerate(per_device):
            built[first + k].problems.extend(problems)
            own.append([*e.id_issues.get(k, []), *issues])
            rows.append(row)
            row_fields.append(row_field)
            lines.append(line)
    _check_matrix(rows, names, row_fields, lines, own)
    for b, name, row, issues in zip(built, names, rows, own, strict=True):
        b.row = row or ()
        b.problems.extend(_problem(path, b.entry.index, i, name) for i in issues)
        b.problems.sort(key=lambda p: p.line)
    return built, fatal


def _problem(path: str, index: int, issue: Issue, names: str) -> Problem:
    sub = f".{issue.field}" if issue.field else ""
    return Problem(path, issue.line, f"devices[{index}]{sub} ({names})", *issue.fault)


def _rows_found(count: int, shown: str) -> Message:
    if count == 1:
        return msg("config.found.one_row", "1 row {value}", value=shown)
    return msg("config.found.rows", "{count} rows {value}", count=count, value=shown)


def _values_found(count: int, shown: str) -> Message:
    if count == 1:
        return msg("config.found.one_value", "1 value {value}", value=shown)
    return msg("config.found.values", "{count} values {value}", count=count, value=shown)


def empty_list() -> Message:
    return msg("config.found.empty_list", "an empty list")


def _expected_row(n: int) -> Message:
    return msg(
        "config.expected.row",
        "a row of {n} distances for this device (the node declares {n} devices: a {n}x{n} matrix, {nn} values)",
        n=n,
        nn=n * n,
    )


def _row_hint() -> Message:
    return msg(
        "config.hint.row", "list its distance to every device of the node in declaration order, 0 for itself"
    )


PerDevice = tuple[Row | None, list[Issue], str, int]  # row, issues, the row's field, its line


def _rows(e: Entry, n: int) -> tuple[list[Issue], list[PerDevice]]:
    """Issues shared by the devices of the entry, and each device's row and own issues."""
    topo = e.keys.get("topology_distance")
    count = len(e.ids)
    unknown: list[PerDevice] = [(None, [], "topology_distance", e.line)] * count
    if topo is None and (n == 1 or not e.readable):
        return [], [((0,) if n == 1 else None, [], "topology_distance", e.line)] * count
    if not e.group:
        if topo is None:
            return [
                Issue(e.line, "topology_distance", Fault(_expected_row(n), describe(None), _row_hint()))
            ], unknown
        return [], [(*_row(topo, n, "topology_distance", False), "topology_distance", line_of(topo))]
    if is_sequence(topo) and topo is not None and len(topo.value) == count:
        out: list[PerDevice] = []
        for k, item in enumerate(topo.value):
            name = f"topology_distance[{k}]"
            out.append((*_row(item, n, name, True), name, line_of(item)))
        return [], out
    if count == 1:
        expected = msg(
            "config.expected.group_row",
            "1 row, one per device of device_ids, each a row of {n} distances (a {n}x{n} matrix)",
            n=n,
        )
    else:
        expected = msg(
            "config.expected.group_rows",
            "{count} rows, one per device of device_ids, each a row of {n} distances (a {n}x{n} matrix)",
            count=count,
            n=n,
        )
    found: Text
    hint: Text
    if topo is None:
        found, hint, line = describe(None), _row_hint(), e.line
    else:
        found = _rows_found(len(topo.value), render(topo)) if is_sequence(topo) else describe(topo)
        hint = msg("config.hint.row_per_device", "one row per device, in the order of device_ids")
        line = line_of(topo)
    return [Issue(line, "topology_distance", Fault(expected, found, hint))], unknown


def _row(node: Node, n: int, name: str, group: bool) -> tuple[Row | None, list[Issue]]:
    line = line_of(node)
    if not is_sequence(node):
        hint: Text = (
            msg("config.hint.group_rows", "device_ids declares a group: give one row (a list) per device")
            if group
            else ""
        )
        return None, [Issue(line, name, Fault(_expected_row(n), describe(node), hint))]
    if len(node.value) != n or (not group and any(is_sequence(v) for v in node.value)):
        hint = _row_hint()
        if not group and any(is_sequence(v) for v in node.value):
            hint = msg(
                "config.hint.one_row", "device_id declares one device: write its row as one list, e.g. [0, 1]"
            )
        found = _values_found(len(node.value), render(node))
        return None, [Issue(line, name, Fault(_expected_row(n), found, hint))]
    row: list[int] = []
    issues: list[Issue] = []
    for k, item in enumerate(node.value):
        value = check_number(DISTANCE, item)
        if isinstance(value, Fault):
            issues.append(Issue(line_of(item), f"{name}[{k}]", value))
        else:
            row.append(int(value))
    return (tuple(row) if not issues else None), issues


def _check_matrix(
    rows: list[Row | None], names: list[str], fields: list[str], lines: list[int], out: list[list[Issue]]
) -> None:
    """Zero diagonal and symmetry, over the rows that could be read."""
    for i, row in enumerate(rows):
        if row is not None and row[i] != 0:
            expected = msg(
                "config.expected.zero_diagonal",
                "0 at position {i}, the distance from {name} to itself",
                i=i,
                name=names[i],
            )
            out[i].append(Issue(lines[i], f"{fields[i]}[{i}]", Fault(expected, str(row[i]))))
    for i, row_i in enumerate(rows):
        for j in range(i + 1, len(rows)):
            row_j = rows[j]
            if row_i is None or row_j is None or row_i[j] == row_j[i]:
                continue
            expected = msg(
                "config.expected.symmetric",
                "the same distance both ways between {a} and {b} (a symmetric matrix)",
                a=names[i],
                b=names[j],
            )
            found = msg(
                "config.found.asymmetric",
                "{a} -> {b} = {ab} (line {line_a}) but {b} -> {a} = {ba} (line {line_b})",
                a=names[i],
                b=names[j],
                ab=row_i[j],
                ba=row_j[i],
                line_a=lines[i],
                line_b=lines[j],
            )
            fault = Fault(expected, found, msg("config.hint.equal", "make the two values equal"))
            out[i].append(Issue(lines[i], f"{fields[i]}[{j}]", fault))
            out[j].append(Issue(lines[j], f"{fields[j]}[{i}]", fault))
