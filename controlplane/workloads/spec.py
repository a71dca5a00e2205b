"""WorkloadSpec validation and defaults, and its YAML file form.

Every problem is listed by field at once; an invalid spec changes nothing.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

import yaml
from google.protobuf import json_format

from kunlun_common.api import workload_pb2
from kunlun_common.errors import ConfigError
from kunlun_common.messages import Message, msg, msg_list
from kunlun_common.names import DEVICE_TYPES, sglang_refusal_message

NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$")
PACKAGE_RE = re.compile(r"^(?P<name>[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?)@sha256:[0-9a-f]{64}$")
PIN_RE = re.compile(r"^((?P<node>[a-z0-9][a-z0-9-]*)/)?(?P<type>[a-z]+)(:(?P<index>\d+))?$")
QUANTIZATIONS = ("none", "w8a8", "int8", "fp8", "int4", "awq", "gptq")
DTYPES = ("auto", "fp16", "bf16", "fp32")
PRIORITIES = ("high", "normal", "low")
ENGINES = ("sglang", "template", "test")
FENCING = ("", "strict", "available")
"""`fencing` values ("" is strict)."""
FIELDS = [f.name for f in workload_pb2.WorkloadSpec.DESCRIPTOR.fields]
MAX_REPLICAS = 1000
MAX_DEVICES = 64


class SpecError(ConfigError):
    """The spec is invalid; `problems` lists each as 'field: what is wrong; the fix'."""

    def __init__(self, problems: list[Message]) -> None:
        super().__init__(msg_list("spec.invalid", "invalid workload spec:\n{parts}", problems))
        self.problems = [str(p) for p in problems]


def with_defaults(spec: workload_pb2.WorkloadSpec) -> workload_pb2.WorkloadSpec:
    s = workload_pb2.WorkloadSpec()
    s.CopyFrom(spec)
    if not s.engine:
        s.engine = "sglang"
    if not s.quantization:
        s.quantization = "none"
    if not s.dtype:
        s.dtype = "bf16" if s.quantization == "none" else "auto"
    if not s.devices_per_instance:
        s.devices_per_instance = 1
    if s.replicas == 0:
        s.replicas = 1  # a submitted spec runs at least one instance; `workload scale NAME 0` stops all
    if not s.priority:
        s.priority = "normal"
    if s.package and not s.model and (pm := PACKAGE_RE.match(s.package)):
        s.model = pm["name"]
    if not s.name and s.model:
        s.name = (
            re.sub(r"[^a-z0-9.-]+", "-", s.model.lower().rsplit("/", 1)[-1]).strip("-.")[:63] or "workload"
        )
    return s


def validate(spec: workload_pb2.WorkloadSpec) -> list[Message]:
    """Every problem of a spec (after defaults)."""
    p: list[Message] = []
    if not NAME_RE.match(spec.name):
        p.append(
            msg(
                "spec.name_not_valid_name",
                "name: {name!r} is not a valid name; use lowercase letters, digits, '-' and '.', at most 63",
                name=spec.name,
            )
        )
    if not spec.model.strip():
        p.append(
            msg(
                "spec.model_required_give_model",
                "model: required; give a model path or name, e.g. qwen2-0.5b",
            )
        )
    if spec.engine not in ENGINES:
        p.append(
            msg(
                "spec.engine_expected_one_found",
                "engine: expected one of {items}, found {engine!r}",
                items=", ".join(ENGINES),
                engine=spec.engine,
            )
        )
    if spec.fencing not in FENCING:
        p.append(
            msg(
                "spec.fencing_expected_one_strict",
                "fencing: expected one of strict, available, found {fencing!r}",
                fencing=spec.fencing,
            )
        )
    if spec.engine == "template" and "{port}" not in spec.command_template:
        p.append(
            msg(
                "spec.command_template_engine_template",
                "command_template: an engine template must contain {{port}} (and usually {{model}}, {{host}})",
            )
        )
    if spec.quantization not in QUANTIZATIONS:
        p.append(
            msg(
                "spec.quantization_expected_one_found",
                "quantization: expected one of {items}, found {quantization!r}",
                items=", ".join(QUANTIZATIONS),
                quantization=spec.quantization,
            )
        )
    if spec.dtype not in DTYPES:
        p.append(
            msg(
                "spec.dtype_expected_one_found",
                "dtype: expected one of {items}, found {dtype!r}",
                items=", ".join(DTYPES),
                dtype=spec.dtype,
            )
        )
    if not 1 <= spec.devices_per_instance <= MAX_DEVICES:
        p.append(
            msg(
                "spec.devices_per_instance_expected",
                "devices_per_instance: expected 1..{max_devices}, found {devices_per_instance}",
                max_devices=MAX_DEVICES,
                devices_per_instance=spec.devices_per_instance,
            )
        )
    if spec.memory_per_device_mb < 0:
        p.append(
            msg(
                "spec.memory_per_device_mb",
                "memory_per_device_mb: expected >= 0, found {memory_per_device_mb}",
                memory_per_device_mb=spec.memory_per_device_mb,
            )
        )
    if not 0 <= spec.replicas <= MAX_REPLICAS:
        p.append(
            msg(
                "spec.replicas_expected_found",
                "replicas: expected 0..{max_replicas}, found {replicas}",
                max_replicas=MAX_REPLICAS,
                replicas=spec.replicas,
            )
        )
    if spec.priority not in PRIORITIES:
        p.append(
            msg(
                "spec.priority_expected_one_found",
                "priority: expected one of {items}, found {priority!r}",
                items=", ".join(PRIORITIES),
                priority=spec.priority,
            )
        )
    for t in spec.preferred_device_types:
        if t not in DEVICE_TYPES:
            p.append(
                msg(
                    "spec.preferred_device_types_unknown",
                    "preferred_device_types: unknown type {t!r}; expected some of {items}",
                    t=t,
                    items=", ".join(DEVICE_TYPES),
                )
            )
    if spec.engine == "sglang":
        named = [*spec.preferred_device_types, *([m["type"]] if (m := PIN_RE.match(spec.pin)) else [])]
        for t in dict.fromkeys(named):
            refusal = sglang_refusal_message(t)
            if refusal is not None:
                p.append(
                    msg(
                        "spec.engine_sglang_cannot_run",
                        "engine: sglang cannot run on {t} devices: {sglang_refusal}; use engine: template",
                        t=t,
                        sglang_refusal=refusal,
                    )
                )
    if spec.pin:
        m = PIN_RE.match(spec.pin)
        if not m or m["type"] not in DEVICE_TYPES:
            p.append(
                msg(
                    "spec.pin_not_device_use",
                    "pin: {pin!r} is not a device; use TYPE:INDEX (ascend:0) or NODE/TYPE:INDEX (node-a/ascend:0)",
                    pin=spec.pin,
                )
            )
        elif spec.devices_per_instance != 1 and m["index"] is not None:
            p.append(msg("spec.pin_pin_one_device", "pin: a pin to one device needs devices_per_instance 1"))
        elif spec.replicas > 1 and m["index"] is not None:
            p.append(msg("spec.pin_pin_one_device_2", "pin: a pin to one device allows at most 1 replica"))
    if spec.max_concurrency < 0:
        p.append(
            msg(
                "spec.max_concurrency_expected_found",
                "max_concurrency: expected >= 0, found {max_concurrency}",
                max_concurrency=spec.max_concurrency,
            )
        )
    if spec.batch_size < 0:
        p.append(
            msg(
                "spec.batch_size_expected_found",
                "batch_size: expected >= 0, found {batch_size}",
                batch_size=spec.batch_size,
            )
        )
    if spec.package and not PACKAGE_RE.match(spec.package):
        p.append(
            msg(
                "spec.package_not_name_sha",
                "package: {package!r} is not NAME@sha256:DIGEST; copy it from `kunlun-cli model inspect PKG`",
                package=spec.package,
            )
        )
    p += rolling_problems(spec)
    for k in spec.env:
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k):
            p.append(msg("spec.env_not_valid_variable", "env: {k!r} is not a valid variable name", k=k))
    return p


def rolling_problems(spec: workload_pb2.WorkloadSpec) -> list[Message]:
    """max_surge / max_unavailable (README "Rolling updates"): in range, and able to make progress."""
    p: list[Message] = []
    surge = spec.max_surge if spec.HasField("max_surge") else None
    unavailable = spec.max_unavailable if spec.HasField("max_unavailable") else None
    for name, v in (("max_surge", surge), ("max_unavailable", unavailable)):
        if v is not None and not 0 <= v <= MAX_REPLICAS:
            p.append(
                msg(
                    "spec.expected_found",
                    "{name}: expected 0..{max_replicas}, found {v}",
                    name=name,
                    max_replicas=MAX_REPLICAS,
                    v=v,
                )
            )
    if surge == 0 and unavailable == 0:
        p.append(
            msg(
                "spec.max_surge_max_unavailable",
                "max_surge, max_unavailable: both 0 would never replace an instance after a spec change; set max_surge (start new instances first) or max_unavailable (stop old ones first) to 1",
            )
        )
    m = PIN_RE.match(spec.pin) if spec.pin else None
    if m and m["index"] is not None and unavailable == 0:
        p.append(
            msg(
                "spec.max_unavailable_cannot_work",
                "max_unavailable: 0 cannot work with a pin to one device (the new instance needs the old one's device); set max_unavailable: 1 or leave it unset",
            )
        )
    return p


def checked(spec: workload_pb2.WorkloadSpec) -> workload_pb2.WorkloadSpec:
    """Defaults applied and validated; raises SpecError listing every problem."""
    s = with_defaults(spec)
    problems = validate(s)
    if problems:
        raise SpecError(problems)
    return s


def parse_spec_yaml(text: str, source: str = "spec.yaml") -> workload_pb2.WorkloadSpec:
    """The YAML file form: a mapping with WorkloadSpec's field names (unknown keys refused)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise SpecError(
            [
                msg(
                    "spec.yaml_invalid",
                    "{source}{where}: not valid YAML ({problem})",
                    source=source,
                    where=where,
                    problem=getattr(e, "problem", e),
                )
            ]
        ) from None
    if not isinstance(data, dict):
        raise SpecError(
            [
                msg(
                    "spec.yaml_not_mapping",
                    "{source}: expected a mapping of workload fields, found {found}",
                    source=source,
                    found=type(data).__name__,
                )
            ]
        )
    problems: list[Message] = []
    clean: dict[str, Any] = {}
    for k, v in data.items():
        if k not in FIELDS:
            guess = difflib.get_close_matches(str(k), FIELDS, n=1)
            if guess:
                problems.append(
                    msg(
                        "spec.unknown_field_guess",
                        "{key}: unknown field; did you mean {guess!r}?",
                        key=str(k),
                        guess=guess[0],
                    )
                )
            else:
                problems.append(msg("spec.unknown_field", "{key}: unknown field", key=str(k)))
            continue
        clean[k] = v
    spec = workload_pb2.WorkloadSpec()
    if not problems:
        try:
            json_format.ParseDict(clean, spec)
        except json_format.ParseError as e:
            problems.append(msg("spec.yaml_field_type", "{source}: {error}", source=source, error=e))
    if problems:
        raise SpecError(problems)
    return spec


def spec_json(spec: workload_pb2.WorkloadSpec) -> dict[str, Any]:
    """The spec as a plain dict with every field (numbers as numbers)."""
    return {
        "name": spec.name,
        "model": spec.model,
        "engine": spec.engine,
        "command_template": spec.command_template,
        "quantization": spec.quantization,
        "dtype": spec.dtype,
        "devices_per_instance": spec.devices_per_instance,
        "memory_per_device_mb": spec.memory_per_device_mb,
        "replicas": spec.replicas,
        "priority": spec.priority,
        "preferred_device_types": list(spec.preferred_device_types),
        "pin": spec.pin,
        "max_concurrency": spec.max_concurrency,
        "batch_size": spec.batch_size,
        "require_p2p": spec.require_p2p,
        "engine_args": list(spec.engine_args),
        "env": dict(spec.env),
        "package": spec.package,
        "fencing": spec.fencing,
        "max_surge": spec.max_surge if spec.HasField("max_surge") else None,
        "max_unavailable": spec.max_unavailable if spec.HasField("max_unavailable") else None,
    }


RUNTIME_FIELDS = ("replicas", "max_surge", "max_unavailable")
"""Fields whose change starts no new generation: no instance has to be replaced for them."""


def same_engine_spec(a: workload_pb2.WorkloadSpec, b: workload_pb2.WorkloadSpec) -> bool:
    """Equal except for `RUNTIME_FIELDS`: the running instances can stay as they are."""
    ja, jb = spec_json(a), spec_json(b)
    for f in RUNTIME_FIELDS:
        ja.pop(f)
        jb.pop(f)
    return ja == jb
