"""The field table of device-plugin-config.yaml, the Problem type and the checks of single values.

The table (ROOT_FIELDS, NODE_FIELDS, DEVICE_FIELDS...) is what the loader validates against; the shipped
JSON Schema (device-plugin-config.schema.json) says the same for editors, and tests/test_plugin_config.py
compares the two so that they cannot drift apart. Every check here returns a `Fault` (what was expected,
what was found, how to fix it) instead of raising, so that the loader can report every problem at once.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import re
from dataclasses import dataclass
from typing import NamedTuple

from kunlun_common.messages import Message, msg, plain
from kunlun_common.names import DEVICE_TYPES, NODE_NAME_RE, valid_node_name
from node_agent.plugins.config_yaml import (
    MappingNode,
    Node,
    ScalarNode,
    Unsupported,
    describe,
    line_of,
    scalar_value,
)
from node_agent.vendors import aliases

SCHEMA_VERSION = 1
DTYPES = ("fp32", "fp16", "bf16", "int8", "int4", "fp8", "w8a8")
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_DEVICES = 256  # per node; bounds the N x N topology work
MAX_FILE_BYTES = 1 << 20
ATTRIBUTE_TYPES = ("string", "integer", "number", "boolean")  # JSON types of custom_attributes values


Text = str | Message
"""A problem's part: a message with an id (translated), or a value shown as is."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong in a config file, rendered `FILE:LINE: FIELD: expected X, found Y[; HINT]`."""

    path: str
    line: int
    field: str
    expected: Text
    found: Text
    hint: Text = ""

    def __str__(self) -> str:
        text = f"{self.path}:{self.line}: {self.field}: expected {self.expected}, found {self.found}"
        return f"{text}; {self.hint}" if self.hint else text

    def message(self) -> Message:
        """This problem with its message ids: the frame and each of expected, found and hint are
        translated on their own (str() of it is the English text above)."""
        expected, found = as_message(self.expected), as_message(self.found)
        if self.hint:
            return msg(
                "config.problem_hint",
                "{path}:{line}: {field}: expected {expected}, found {found}; {hint}",
                path=self.path,
                line=self.line,
                field=self.field,
                expected=expected,
                found=found,
                hint=as_message(self.hint),
            )
        return msg(
            "config.problem",
            "{path}:{line}: {field}: expected {expected}, found {found}",
            path=self.path,
            line=self.line,
            field=self.field,
            expected=expected,
            found=found,
        )


def as_message(text: Text) -> Message:
    """A problem's part as a message: a value without words (a number, a name) is shown as is."""
    return text if isinstance(text, Message) else plain(text)


class Fault(NamedTuple):
    """A problem before it knows its file, line and field."""

    expected: Text
    found: Text
    hint: Text = ""


class _NoDefault:
    def __repr__(self) -> str:
        return "NO_DEFAULT"


NO_DEFAULT = _NoDefault()


@dataclass(frozen=True)
class FieldSpec:
    """One key of a section. `type` is the JSON Schema type of its value."""

    name: str
    type: str
    required: bool = False
    nullable: bool = False
    default: object = NO_DEFAULT
    minimum: float | None = None
    exclusive_minimum: float | None = None
    maximum: float | None = None
    enum: tuple[object, ...] = ()
    pattern: str | None = None
    min_length: int | None = None
    items: str | None = None  # JSON type of the items of an array (or the values of an object)
    item_enum: tuple[str, ...] = ()
    min_items: int | None = None
    unique_items: bool = False
    unit: str = ""
    example: str = ""


ROOT_FIELDS = (
    FieldSpec("schema_version", "integer", required=True, enum=(SCHEMA_VERSION,)),
    FieldSpec("node", "object", required=True),
    FieldSpec("devices", "array", required=True, items="object", min_items=1),
)
NODE_FIELDS = (
    FieldSpec("name", "string", required=True, pattern=NODE_NAME_RE.pattern, example="node-a"),
    FieldSpec("address", "string", required=True, min_length=1, example="127.0.0.1"),
    FieldSpec("simulated", "boolean", default=False),
    FieldSpec("simulator_state", "string", nullable=True, default=None, min_length=1),
    FieldSpec(
        "health_interval_seconds",
        "number",
        default=1.0,
        exclusive_minimum=0,
        maximum=60,
        unit="seconds",
        example="1.0",
    ),
    FieldSpec("plugin_socket_dir", "string", nullable=True, default=None, min_length=1),
)
DEVICE_ID = FieldSpec("device_id", "integer", minimum=0, maximum=INT32_MAX, example="0")
DISTANCE = FieldSpec("topology_distance", "integer", minimum=0, maximum=INT32_MAX, example="1")


def _mb(name: str, minimum: int, required: bool = False, default: object = NO_DEFAULT) -> FieldSpec:
    return FieldSpec(
        name,
        "integer",
        required,
        default=default,
        minimum=minimum,
        maximum=INT64_MAX,
        unit="MB",
        example="32768",
    )


def _tflops(name: str) -> FieldSpec:
    return FieldSpec(name, "number", default=0, minimum=0, unit="TFLOPS", example="320")


DEVICE_FIELDS = (
    FieldSpec("device_type", "string", required=True, enum=DEVICE_TYPES),
    DEVICE_ID,
    FieldSpec("device_ids", "array", items="integer", min_items=1, unique_items=True),
    FieldSpec("model", "string", required=True, min_length=1, example="910B"),
    FieldSpec("p2p_enabled", "boolean", default=False),
    FieldSpec("p2p_bandwidth_gbps", "number", default=0, minimum=0, unit="Gbps", example="56"),
    FieldSpec("topology_distance", "array"),
    _mb("total_memory_mb", minimum=1),
    _mb("hbm_memory_mb", required=True, minimum=1),
    _mb("sys_memory_mb", default=0, minimum=0),
    _tflops("fp16_compute_power_tflops"),
    _tflops("bf16_compute_power_tflops"),
    _tflops("int8_compute_power_tflops"),
    FieldSpec(
        "supported_dtypes",
        "array",
        required=True,
        items="string",
        item_enum=DTYPES,
        min_items=1,
        unique_items=True,
    ),
    FieldSpec("custom_attributes", "object", default={}),
)
DEVICE_ONE_OF = ("device_id", "device_ids")  # exactly one of them

# Names people write instead of the real ones.
KEY_ALIASES = {
    "type": "device_type",
    "vendor": "device_type",
    "id": "device_id",
    "index": "device_id",
    "device_index": "device_id",
    "ids": "device_ids",
    "indices": "device_ids",
    "dtypes": "supported_dtypes",
    "fp16_tflops": "fp16_compute_power_tflops",
    "bf16_tflops": "bf16_compute_power_tflops",
    "int8_tflops": "int8_compute_power_tflops",
    "memory_mb": "hbm_memory_mb",
    "hbm_mb": "hbm_memory_mb",
    "topology": "topology_distance",
    "distances": "topology_distance",
    "attributes": "custom_attributes",
    "version": "schema_version",
    "device": "devices",
    "nodes": "node",
    "host": "address",
    "ip": "address",
}
VENDOR_ALIASES = aliases()  # every vendor record's aliases (node_agent.vendors)
DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "float8": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
}


def suggest(
    word: str, choices: tuple[str, ...] | list[str], aliases: dict[str, str] | None = None
) -> Message:
    """A "did you mean" hint, or the list of choices when nothing is close."""
    low = word.lower()
    if low in choices and low != word:
        return msg("config.hint.lowercase_quoted", "write it in lowercase: '{value}'", value=low)
    if aliases and low in aliases and aliases[low] in choices:
        return msg("config.hint.did_you_mean", "did you mean '{value}'?", value=aliases[low])
    close = difflib.get_close_matches(low, list(choices), n=1, cutoff=0.6)
    if close:
        return msg("config.hint.did_you_mean", "did you mean '{value}'?", value=close[0])
    return msg("config.hint.valid", "valid: {choices}", choices=", ".join(choices))


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def expected_text(spec: FieldSpec) -> Text:
    """'an integer >= 1 (MB)', 'true or false', 'one of ascend, cambricon, hygon, nvidia'..."""
    text: Text
    if spec.enum:
        choices = ", ".join(str(v) for v in spec.enum)
        text = (
            msg("config.expected.one_of", "one of {choices}", choices=choices)
            if len(spec.enum) > 1
            else choices
        )
    elif spec.type == "boolean":
        text = msg("config.expected.bool", "true or false")
    elif spec.type == "string":
        text = (
            msg("config.expected.non_empty_string", "a non-empty string")
            if spec.min_length
            else msg("config.expected.string", "a string")
        )
    else:
        text = (
            msg("config.expected.integer", "an integer")
            if spec.type == "integer"
            else msg("config.expected.number", "a number")
        )
        bounds = []
        if spec.minimum is not None:
            bounds.append(f">= {_fmt(spec.minimum)}")
        if spec.exclusive_minimum is not None:
            bounds.append(f"> {_fmt(spec.exclusive_minimum)}")
        if spec.maximum is not None and spec.maximum <= 1e6:
            bounds.append(f"<= {_fmt(spec.maximum)}")
        if len(bounds) == 1:
            text = msg("config.expected.bound", "{kind} {bound}", kind=text, bound=bounds[0])
        elif bounds:
            text = msg(
                "config.expected.bounds", "{kind} {low} and {high}", kind=text, low=bounds[0], high=bounds[1]
            )
        if spec.unit:
            text = msg("config.expected.unit", "{what} ({unit})", what=text, unit=_unit(spec.unit))
    return msg("config.expected.or_null", "{what} or null", what=as_message(text)) if spec.nullable else text


def _unit(unit: str) -> Text:
    return msg("config.unit.seconds", "seconds") if unit == "seconds" else unit


_UNIT_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z/ ]*?)\s*$")
_TO_MB = {"": 1, "k": 1 / 1024, "m": 1, "g": 1024, "t": 1024 * 1024}


def _number_hint(spec: FieldSpec, text: str) -> Message:
    m = _UNIT_RE.match(text)
    unit = _unit(spec.unit) if spec.unit else msg("config.unit.units", "units")
    if m and not m[2]:
        return msg("config.hint.unquote", "remove the quotes: {value}", value=m[1])
    if m and spec.unit == "MB":
        prefix = m[2].lower().removesuffix("b").removesuffix("i")
        if prefix in _TO_MB and (mb := float(m[1]) * _TO_MB[prefix]).is_integer():
            return msg("config.hint.number_of_mb", "write the number of MB, e.g. {value}", value=int(mb))
    if m:
        return msg(
            "config.hint.drop_unit",
            "write the number of {unit} without the unit, e.g. {value}",
            unit=as_message(unit),
            value=m[1],
        )
    if spec.example:
        return msg(
            "config.hint.number_of",
            "write the number of {unit}, e.g. {value}",
            unit=as_message(unit),
            value=spec.example,
        )
    return msg("config.hint.write_number", "write a number")


def check_number(spec: FieldSpec, node: Node | None) -> int | float | Fault:
    """An integer (spec.type 'integer') or a number ('number') within the spec's bounds."""
    expected = expected_text(spec)
    found = describe(node)
    if node is None:
        return Fault(expected, found, _add_hint(spec))
    value = scalar_value(node) if isinstance(node, ScalarNode) else None
    if isinstance(value, str):
        return Fault(expected, found, _number_hint(spec, value))
    if isinstance(value, bool):
        return Fault(expected, found, msg("config.hint.not_bool", "write a number, not true/false"))
    if not isinstance(value, int | float):
        return Fault(expected, found)
    if isinstance(value, float) and not math.isfinite(value):
        return Fault(expected, found, msg("config.hint.finite", "write a finite number"))
    if spec.type == "integer" and isinstance(value, float):
        hint = (
            msg("config.hint.whole_eg", "write a whole number, e.g. {value}", value=int(value))
            if value.is_integer()
            else msg("config.hint.whole", "write a whole number")
        )
        return Fault(expected, found, hint)
    if (spec.minimum is not None and value < spec.minimum) or (
        spec.exclusive_minimum is not None and value <= spec.exclusive_minimum
    ):
        return Fault(
            expected, found, msg("config.hint.negative", "negative values are refused") if value < 0 else ""
        )
    if spec.maximum is not None and value > spec.maximum:
        at_most = msg(
            "config.expected.at_most",
            "{what} and <= {max}",
            what=as_message(expected),
            max=_fmt(spec.maximum),
        )
        return Fault(at_most, found)
    return value


def _add_hint(spec: FieldSpec) -> Text:
    if not spec.example:
        return ""
    return msg("config.hint.add", "add {field}: {value}", field=spec.name, value=spec.example)


def check_bool(spec: FieldSpec, node: Node | None) -> bool | Fault:
    value = scalar_value(node) if isinstance(node, ScalarNode) else None
    if isinstance(value, bool):
        return value
    hint: Text = ""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        hint = msg("config.hint.unquote", "remove the quotes: {value}", value=value.lower())
    elif isinstance(value, str) and value.lower() in ("yes", "no", "on", "off", "y", "n"):
        hint = msg(
            "config.hint.yaml11_bool",
            "YAML 1.1 read yes/no/on/off as booleans, YAML 1.2 and editors do not: write true or false",
        )
    elif isinstance(value, int | float):
        hint = msg("config.hint.bool_not_number", "write true or false, not a number")
    elif node is None:
        hint = msg("config.hint.add", "add {field}: {value}", field=spec.name, value="false")
    return Fault(expected_text(spec), describe(node), hint)


def check_str(spec: FieldSpec, node: Node | None) -> str | Fault | None:
    """A string (or null if spec.nullable), checked against the spec's enum, pattern and length."""
    expected = expected_text(spec)
    value = scalar_value(node) if isinstance(node, ScalarNode) else Unsupported("", "")
    if value is None and spec.nullable and node is not None:
        return None
    if not isinstance(value, str):
        hint: Text = ""
        if isinstance(node, ScalarNode) and isinstance(value, bool | int | float):
            hint = msg(
                "config.hint.quote_it", 'quote it: {field}: "{value}"', field=spec.name, value=node.value
            )
        elif node is None:
            hint = _add_hint(spec)
        return Fault(expected, describe(node), hint)
    if spec.enum and value not in spec.enum:
        aliases = VENDOR_ALIASES if spec.name == "device_type" else None
        return Fault(expected, describe(node), suggest(value, [str(v) for v in spec.enum], aliases))
    if spec.min_length and len(value) < spec.min_length:
        return Fault(expected, msg("config.found.empty_string", "an empty string"))
    if spec.name == "name" and not (valid_node_name(value) and NODE_NAME_RE.fullmatch(value)):
        hint = msg(
            "config.hint.dns_label",
            "a DNS label: lowercase letters, digits and '-', at most 63 characters, e.g. node-a",
        )
        if valid_node_name(value.lower()):
            hint = msg("config.hint.lowercase", "write it in lowercase: {value}", value=value.lower())
        return Fault(msg("config.expected.node_name", "a node name (DNS label)"), describe(node), hint)
    if spec.name == "address" and not valid_address(value):
        return Fault(
            msg("config.expected.address", "an IP address or a hostname"),
            describe(node),
            msg("config.hint.address", "e.g. 127.0.0.1 or node-a.cluster.local"),
        )
    return value


def check_scalar(spec: FieldSpec, node: Node | None) -> str | bool | int | float | Fault | None:
    """The value of a boolean, string or number field (None only for a nullable string)."""
    if spec.type == "boolean":
        return check_bool(spec, node)
    if spec.type == "string":
        return check_str(spec, node)
    return check_number(spec, node)


_HOST_LABEL_RE = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def valid_address(text: str) -> bool:
    """An IPv4/IPv6 address or an RFC 1123 hostname."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        pass
    host = text.removesuffix(".")
    if not host or len(host) > 253 or re.fullmatch(r"[0-9.]+", host):
        return False
    return all(_HOST_LABEL_RE.match(label) for label in host.split("."))


@dataclass(frozen=True)
class Issue:
    """A fault with its line and its field relative to the section it was found in."""

    line: int
    field: str
    fault: Fault


def merge_hint() -> Message:
    return msg(
        "config.hint.merge_keys",
        "YAML merge keys are not supported: write the fields out (or group identical devices with device_ids)",
    )


def read_keys(node: Node, specs: tuple[FieldSpec, ...]) -> tuple[dict[str, Node], list[Issue]]:
    """The known keys of a mapping; unknown, duplicate and non-string keys become issues."""
    known = [s.name for s in specs]
    keys: dict[str, Node] = {}
    first_line: dict[str, int] = {}
    issues: list[Issue] = []
    for key_node, value_node in node.value if isinstance(node, MappingNode) else []:
        key = scalar_value(key_node) if isinstance(key_node, ScalarNode) else None
        line = line_of(key_node)
        if not isinstance(key, str):
            issues.append(
                Issue(
                    line,
                    "(key)",
                    Fault(
                        msg("config.expected.key_name", "a key name"),
                        describe(key_node),
                        suggest(str(key), known),
                    ),
                )
            )
        elif key in first_line:
            found = msg(
                "config.found.key_again",
                "'{key}' again (first on line {first})",
                key=key,
                first=first_line[key],
            )
            issues.append(Issue(line, key, Fault(each_once(), found, remove_one())))
        elif key not in known:
            hint = merge_hint() if key == "<<" else suggest(key, known, KEY_ALIASES)
            unknown = msg("config.found.unknown_key", "unknown key '{key}'", key=key)
            issues.append(
                Issue(line, key, Fault(msg("config.expected.known_key", "a known key"), unknown, hint))
            )
            first_line[key] = line
        else:
            keys[key] = value_node
            first_line[key] = line
    return keys, issues


def each_once() -> Message:
    return msg("config.expected.key_once", "each key once")


def remove_one() -> Message:
    return msg("config.hint.remove_one", "remove one of them")
