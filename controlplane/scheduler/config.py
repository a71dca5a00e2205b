"""`SchedulerConfig` and its YAML form (`scheduler_config.yaml`).

Parsing is strict: unknown keys are refused with a did-you-mean, and every problem is reported at
once in one `ConfigError`, one line per problem, each as `field: expected X, found Y`.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

import yaml

from controlplane.scheduler.model import PRIORITIES
from kunlun_common.errors import ConfigError
from kunlun_common.messages import Message, msg, msg_list
from kunlun_common.profiling import MAX_INTERVAL_MS, MIN_INTERVAL_MS

POLICIES = ("spread", "binpack")
"""Values of `SchedulerConfig.policy`."""

ETCD_MAX_TXN_OPS = 128
"""etcd's default --max-txn-ops."""
OPS_PER_PLACEMENT = 2
"""etcd operations one placement costs in the commit transaction."""
MAX_PLACEMENTS_PER_COMMIT = ETCD_MAX_TXN_OPS // OPS_PER_PLACEMENT
"""Upper bound of `max_placements_per_commit` (64), so that one commit fits one transaction."""
MAX_TEMPERATURE_LIMIT_C = 150.0
"""Upper bound of `temperature_limit_c`."""

DEFAULT_SOURCE = "scheduler_config.yaml"


def _default_weights() -> Mapping[str, float]:
    return MappingProxyType({"high": 3.0, "normal": 1.0, "low": 1.0 / 3.0})


@dataclass(frozen=True)
class SchedulerConfig:
    """How `schedule()` ranks and orders work. YAML keys are these field names."""

    policy: str = "spread"
    """spread: prefer nodes with more free devices; binpack: prefer nodes with fewer."""
    priority_weights: Mapping[str, float] = field(default_factory=_default_weights, hash=False)
    """Weighted fair queueing share of each priority class (high 3 : normal 1 : low 1/3); all > 0.
    Keys missing from YAML keep their default."""
    min_gpu_utilization_threshold: float = 80.0
    """Devices busier than this percentage are used only when no other device fits (0..100)."""
    temperature_limit_c: float = 85.0
    """Devices at or above this temperature get no new work; cooler ones are derated as they heat."""
    preemption_enabled_for: tuple[str, ...] = ("high",)
    """Priority classes whose unplaceable instances may evict running lower-priority instances."""
    node_not_ready_grace_seconds: float = 8.0
    """Time a node stays NotReady (its lease expired, as seen by the acting leader) before its
    instances move elsewhere (> 0). Must exceed the agents' fencing budget minus the node lease (README
    "Node loss: the defaults and their arithmetic")."""
    device_unhealthy_grace_seconds: float = 10.0
    """Time a device may stay unhealthy before its instances are rescheduled (>= 0)."""
    pause_moves_not_ready_fraction: float = 0.5
    """When at least this share of the nodes (and at least two) is NotReady at once, instances of
    `fencing: available` workloads are not moved off them: so many nodes lost together more likely
    means the control plane lost them than that they stopped serving, and their engines keep
    serving (as Kubernetes pauses evictions on a zone disruption). 0..1; 1 never pauses unless
    every node is NotReady. `strict` instances are always moved: their engines stop by themselves."""
    max_placements_per_commit: int = 50
    """Placements per etcd transaction: 1..64, since etcd allows 128 operations per transaction and
    each placement costs 2."""
    advanced_profiling: bool = False
    """Run-time profiling, switched on and off without restart: every replica, agent and gateway
    samples its threads' stacks each `profiling_interval_ms` and writes Chrome trace files into its
    bounded ring (the process's `profiling` settings: folder, files, bytes per file)."""
    profiling_interval_ms: int = 50
    """Milliseconds between two profiling samples (5..60000); read only while advanced_profiling is on."""

    def __post_init__(self) -> None:
        weights = MappingProxyType(dict(self.priority_weights))
        object.__setattr__(self, "priority_weights", weights)
        object.__setattr__(self, "preemption_enabled_for", tuple(self.preemption_enabled_for))
        problems = _check_values(self)
        if problems:
            raise ConfigError(_format("SchedulerConfig", problems))


FIELD_NAMES = tuple(f.name for f in fields(SchedulerConfig))


def _describe(value: object) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, int | float):
        return f"{value:g}" if isinstance(value, float) else str(value)
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return type(value).__name__


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _unknown_key(where: str, key: object, known: tuple[str, ...]) -> Message:
    close = difflib.get_close_matches(str(key), known, n=1)
    if close:
        return msg(
            "scheduler.config.unknown_key_close",
            "{where}{key}: expected a known key (did you mean {close!r}?), found an unknown key",
            where=where,
            key=str(key),
            close=close[0],
        )
    return msg(
        "scheduler.config.unknown_key",
        "{where}{key}: expected a known key (known: {known}), found an unknown key",
        where=where,
        key=str(key),
        known=", ".join(known),
    )


def _one_of(value: object, choices: tuple[str, ...]) -> str:
    hint = ""
    if isinstance(value, str):
        close = difflib.get_close_matches(value, choices, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
    return "expected one of " + ", ".join(repr(c) for c in choices) + hint


def _check_values(config: SchedulerConfig) -> list[Message]:
    """Range and type problems of a built config, as `field: expected X, found Y` lines."""
    problems: list[Message] = []
    if config.policy not in POLICIES:
        problems.append(
            msg(
                "scheduler.config.policy_found",
                "policy: {one_of}, found {policy}",
                one_of=_one_of(config.policy, POLICIES),
                policy=_describe(config.policy),
            )
        )
    for key, weight in config.priority_weights.items():
        if key not in PRIORITIES:
            problems.append(_unknown_key("priority_weights.", key, PRIORITIES))
        elif not _is_number(weight) or not math.isfinite(weight) or weight <= 0:
            problems.append(
                msg(
                    "scheduler.config.priority_weights_expected_number_2",
                    "priority_weights.{key}: expected a number > 0, found {weight}",
                    key=key,
                    weight=_describe(weight),
                )
            )
    for key in PRIORITIES:
        if key not in config.priority_weights:
            problems.append(
                msg(
                    "scheduler.config.priority_weights_expected_number",
                    "priority_weights.{key}: expected a number > 0, found nothing",
                    key=key,
                )
            )
    _check_range(problems, "min_gpu_utilization_threshold", config.min_gpu_utilization_threshold, 0, 100)
    limit = config.temperature_limit_c
    if not _is_number(limit) or not math.isfinite(limit) or not 0 < limit <= MAX_TEMPERATURE_LIMIT_C:
        problems.append(
            msg(
                "scheduler.config.temperature_limit_c_expected",
                "temperature_limit_c: expected a number > 0 and <= {max_temperature_limit_c:g}, found {limit}",
                max_temperature_limit_c=MAX_TEMPERATURE_LIMIT_C,
                limit=_describe(limit),
            )
        )
    seen: set[str] = set()
    for i, prio in enumerate(config.preemption_enabled_for):
        where = f"preemption_enabled_for[{i}]"
        if prio not in PRIORITIES:
            problems.append(
                msg(
                    "scheduler.config.found",
                    "{where}: {one_of}, found {prio}",
                    where=where,
                    one_of=_one_of(prio, PRIORITIES),
                    prio=_describe(prio),
                )
            )
        elif prio in seen:
            problems.append(
                msg(
                    "scheduler.config.expected_each_priority_once",
                    "{where}: expected each priority once, found {prio!r} again",
                    where=where,
                    prio=prio,
                )
            )
        seen.add(str(prio))
    grace = config.node_not_ready_grace_seconds
    if not _is_number(grace) or not math.isfinite(grace) or grace <= 0:
        problems.append(
            msg(
                "scheduler.config.node_not_ready_grace",
                "node_not_ready_grace_seconds: expected a number > 0, found {grace}",
                grace=_describe(grace),
            )
        )
    grace = config.device_unhealthy_grace_seconds
    if not _is_number(grace) or not math.isfinite(grace) or grace < 0:
        problems.append(
            msg(
                "scheduler.config.device_unhealthy_grace_seconds",
                "device_unhealthy_grace_seconds: expected a number >= 0, found {grace}",
                grace=_describe(grace),
            )
        )
    _check_range(problems, "pause_moves_not_ready_fraction", config.pause_moves_not_ready_fraction, 0.0, 1.0)
    cap = config.max_placements_per_commit
    if not isinstance(cap, int) or isinstance(cap, bool) or not 1 <= cap <= MAX_PLACEMENTS_PER_COMMIT:
        problems.append(
            msg(
                "scheduler.config.max_placements_per_commit",
                "max_placements_per_commit: expected an integer from 1 to {max_placements_per_commit} ({etcd_max_txn_ops} etcd operations per transaction, {ops_per_placement} per placement), found {cap}",
                max_placements_per_commit=MAX_PLACEMENTS_PER_COMMIT,
                etcd_max_txn_ops=ETCD_MAX_TXN_OPS,
                ops_per_placement=OPS_PER_PLACEMENT,
                cap=_describe(cap),
            )
        )
    if not isinstance(config.advanced_profiling, bool):
        problems.append(
            msg(
                "scheduler.config.advanced_profiling_expected_true",
                "advanced_profiling: expected true or false, found {advanced_profiling}",
                advanced_profiling=_describe(config.advanced_profiling),
            )
        )
    ms = config.profiling_interval_ms
    if not isinstance(ms, int) or isinstance(ms, bool) or not MIN_INTERVAL_MS <= ms <= MAX_INTERVAL_MS:
        problems.append(
            msg(
                "scheduler.config.profiling_interval_ms_expected",
                "profiling_interval_ms: expected an integer from {min_interval_ms} to {max_interval_ms} (milliseconds between samples), found {ms}",
                min_interval_ms=MIN_INTERVAL_MS,
                max_interval_ms=MAX_INTERVAL_MS,
                ms=_describe(ms),
            )
        )
    return problems


def _check_range(problems: list[Message], name: str, value: object, low: float, high: float) -> None:
    if not (isinstance(value, int | float) and not isinstance(value, bool) and low <= value <= high):
        problems.append(
            msg(
                "scheduler.config.expected_number_from_found",
                "{name}: expected a number from {low:g} to {high:g}, found {value}",
                name=name,
                low=low,
                high=high,
                value=_describe(value),
            )
        )


def _format(source: str, problems: list[Message]) -> Message:
    if len(problems) == 1:
        return msg_list(
            "scheduler.config.problem", "{source}: 1 problem:\n{parts}", problems, "  - ", source=source
        )
    return msg_list(
        "scheduler.config.problems",
        "{source}: {count} problems:\n{parts}",
        problems,
        "  - ",
        source=source,
        count=len(problems),
    )


class _StrictLoader(yaml.SafeLoader):
    """A safe loader that refuses a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: dict[object, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # reported by the base class
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(
                    msg(
                        "scheduler.config.expected_key_once_found",
                        "{key}: expected the key once, found it twice (lines {value} and {line})",
                        key=key,
                        value=seen[key],
                        line=line,
                    )
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def parse_scheduler_config(text: str, source: str = DEFAULT_SOURCE) -> SchedulerConfig:
    """Parse YAML text into a `SchedulerConfig`; missing keys keep their defaults.

    Raises ConfigError naming `source` and listing every problem, one per line.
    """
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except ConfigError as exc:
        raise ConfigError(
            _format(source, [exc.localizable or msg("scheduler.config.yaml", "{text}", text=str(exc))])
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(
            msg("scheduler.config.not_valid_yaml", "{source}: not valid YAML: {exc}", source=source, exc=exc)
        ) from None
    if data is None:
        return SchedulerConfig()
    if not isinstance(data, Mapping):
        raise ConfigError(
            _format(
                source,
                [
                    msg(
                        "scheduler.config.top_level",
                        "(top level): expected a mapping, found {found}",
                        found=_describe(data),
                    )
                ],
            )
        )

    problems: list[Message] = []
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in FIELD_NAMES:
            problems.append(_unknown_key("", key, FIELD_NAMES))
        else:
            values[str(key)] = value

    if "priority_weights" in values:
        weights = values["priority_weights"]
        if isinstance(weights, Mapping):
            values["priority_weights"] = {**_default_weights(), **weights}
        else:
            problems.append(
                msg(
                    "scheduler.config.priority_weights_expected_mapping",
                    "priority_weights: expected a mapping of priority to weight, found {weights}",
                    weights=_describe(weights),
                )
            )
            del values["priority_weights"]
    prios = values.get("preemption_enabled_for")
    if prios is not None:
        if isinstance(prios, list):
            values["preemption_enabled_for"] = tuple(prios)
        else:
            problems.append(
                msg(
                    "scheduler.config.preemption_enabled_for_expected",
                    "preemption_enabled_for: expected a list of priorities, found {prios}",
                    prios=_describe(prios),
                )
            )
            del values["preemption_enabled_for"]
    elif "preemption_enabled_for" in values:
        values["preemption_enabled_for"] = ()

    # Build without validation, then validate everything at once.
    config = object.__new__(SchedulerConfig)
    defaults = SchedulerConfig()
    for f in fields(SchedulerConfig):
        object.__setattr__(config, f.name, values.get(f.name, getattr(defaults, f.name)))
    problems.extend(_check_values(config))
    if problems:
        raise ConfigError(_format(source, problems))
    return SchedulerConfig(**values)


def to_yaml(config: SchedulerConfig) -> str:
    """The YAML form of `config`; `parse_scheduler_config(to_yaml(c)) == c`."""
    data: dict[str, object] = {}
    for f in fields(SchedulerConfig):
        value = getattr(config, f.name)
        if isinstance(value, Mapping):
            value = {k: float(v) for k, v in value.items()}
        elif isinstance(value, tuple):
            value = list(value)
        data[f.name] = value
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
