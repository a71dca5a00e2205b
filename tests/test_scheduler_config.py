"""SchedulerConfig: defaults, strict YAML parsing with every problem at once, round trip."""

from __future__ import annotations

import pytest

from controlplane.scheduler import SchedulerConfig, parse_scheduler_config, to_yaml
from controlplane.scheduler.config import MAX_PLACEMENTS_PER_COMMIT
from kunlun_common.errors import ConfigError


def problems(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_scheduler_config(text)
    return str(info.value)


def test_defaults() -> None:
    c = SchedulerConfig()
    assert (
        c.policy,
        dict(c.priority_weights),
        c.min_gpu_utilization_threshold,
        c.temperature_limit_c,
        c.preemption_enabled_for,
        c.node_not_ready_grace_seconds,
        c.device_unhealthy_grace_seconds,
        c.max_placements_per_commit,
    ) == ("spread", {"high": 3.0, "normal": 1.0, "low": 1 / 3}, 80.0, 85.0, ("high",), 8.0, 10.0, 50)
    assert MAX_PLACEMENTS_PER_COMMIT == 64


@pytest.mark.parametrize("text", ["", "# nothing\n", "{}\n"])
def test_empty_file_gives_defaults(text: str) -> None:
    assert parse_scheduler_config(text) == SchedulerConfig()


def test_full_file() -> None:
    text = """
policy: binpack
priority_weights: {high: 4, low: 0.5}
min_gpu_utilization_threshold: 70
temperature_limit_c: 90.5
preemption_enabled_for: [high, normal]
node_not_ready_grace_seconds: 45
device_unhealthy_grace_seconds: 0
max_placements_per_commit: 64
"""
    c = parse_scheduler_config(text)
    assert c == SchedulerConfig(
        policy="binpack",
        priority_weights={"high": 4, "normal": 1.0, "low": 0.5},
        min_gpu_utilization_threshold=70,
        temperature_limit_c=90.5,
        preemption_enabled_for=("high", "normal"),
        node_not_ready_grace_seconds=45,
        device_unhealthy_grace_seconds=0,
        max_placements_per_commit=64,
    )
    assert dict(c.priority_weights) == {"high": 4, "normal": 1.0, "low": 0.5}


def test_empty_preemption_list_disables_preemption() -> None:
    assert parse_scheduler_config("preemption_enabled_for: []\n").preemption_enabled_for == ()
    assert parse_scheduler_config("preemption_enabled_for:\n").preemption_enabled_for == ()


def test_unknown_key_with_did_you_mean() -> None:
    assert problems("polcy: spread\n") == (
        "scheduler_config.yaml: 1 problem:\n"
        "  - polcy: expected a known key (did you mean 'policy'?), found an unknown key"
    )


def test_unknown_key_without_a_close_match_lists_the_keys() -> None:
    assert problems("zzz: 1\n") == (
        "scheduler_config.yaml: 1 problem:\n"
        "  - zzz: expected a known key (known: policy, priority_weights, min_gpu_utilization_threshold, "
        "temperature_limit_c, preemption_enabled_for, node_not_ready_grace_seconds, "
        "device_unhealthy_grace_seconds, pause_moves_not_ready_fraction, max_placements_per_commit, "
        "advanced_profiling, profiling_interval_ms), found an unknown key"
    )


def test_every_problem_at_once() -> None:
    text = """
policy: pack
priority_weights: {high: 0, norml: 1}
min_gpu_utilization_threshold: 120
temperature_limit_c: hot
preemption_enabled_for: [high, hgh, high]
node_not_ready_grace_seconds: 0
device_unhealthy_grace_seconds: -1
max_placements_per_commit: 128
max_placement_per_commit: 1
"""
    assert problems(text) == (
        "scheduler_config.yaml: 11 problems:\n"
        "  - max_placement_per_commit: expected a known key (did you mean 'max_placements_per_commit'?), "
        "found an unknown key\n"
        "  - policy: expected one of 'spread', 'binpack' (did you mean 'binpack'?), found 'pack'\n"
        "  - priority_weights.high: expected a number > 0, found 0\n"
        "  - priority_weights.norml: expected a known key (did you mean 'normal'?), found an unknown key\n"
        "  - min_gpu_utilization_threshold: expected a number from 0 to 100, found 120\n"
        "  - temperature_limit_c: expected a number > 0 and <= 150, found 'hot'\n"
        "  - preemption_enabled_for[1]: expected one of 'high', 'normal', 'low' (did you mean 'high'?), "
        "found 'hgh'\n"
        "  - preemption_enabled_for[2]: expected each priority once, found 'high' again\n"
        "  - node_not_ready_grace_seconds: expected a number > 0, found 0\n"
        "  - device_unhealthy_grace_seconds: expected a number >= 0, found -1\n"
        "  - max_placements_per_commit: expected an integer from 1 to 64 (128 etcd operations per "
        "transaction, 2 per placement), found 128"
    )


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("policy: 3\n", "policy: expected one of 'spread', 'binpack', found 3"),
        (
            "priority_weights: [1, 2]\n",
            "priority_weights: expected a mapping of priority to weight, found a list",
        ),
        (
            "priority_weights: {low: true}\n",
            "priority_weights.low: expected a number > 0, found true (a boolean)",
        ),
        (
            "min_gpu_utilization_threshold: '50'\n",
            "min_gpu_utilization_threshold: expected a number from 0 to 100, found '50'",
        ),
        ("temperature_limit_c: .nan\n", "temperature_limit_c: expected a number > 0 and <= 150, found nan"),
        (
            "preemption_enabled_for: high\n",
            "preemption_enabled_for: expected a list of priorities, found 'high'",
        ),
        (
            "node_not_ready_grace_seconds:\n",
            "node_not_ready_grace_seconds: expected a number > 0, found nothing",
        ),
        (
            "max_placements_per_commit: 10.5\n",
            "max_placements_per_commit: expected an integer from 1 to 64 "
            "(128 etcd operations per transaction, 2 per placement), found 10.5",
        ),
        (
            "max_placements_per_commit: 0\n",
            "max_placements_per_commit: expected an integer from 1 to 64 "
            "(128 etcd operations per transaction, 2 per placement), found 0",
        ),
    ],
)
def test_single_problems(text: str, problem: str) -> None:
    assert problems(text) == f"scheduler_config.yaml: 1 problem:\n  - {problem}"


def test_top_level_must_be_a_mapping() -> None:
    assert (
        problems("- a\n- b\n")
        == "scheduler_config.yaml: 1 problem:\n  - (top level): expected a mapping, found a list"
    )


def test_duplicate_key_refused() -> None:
    assert problems("policy: spread\npolicy: binpack\n") == (
        "scheduler_config.yaml: 1 problem:\n  - policy: expected the key once, found it twice (lines 1 and 2)"
    )


def test_invalid_yaml_names_the_source() -> None:
    with pytest.raises(ConfigError, match=r"^/etc/kunlun/scheduler_config.yaml: not valid YAML: "):
        parse_scheduler_config("policy: [spread\n", source="/etc/kunlun/scheduler_config.yaml")


def test_constructor_validates_too() -> None:
    with pytest.raises(ConfigError) as info:
        SchedulerConfig(policy="fast", max_placements_per_commit=0)
    assert str(info.value) == (
        "SchedulerConfig: 2 problems:\n"
        "  - policy: expected one of 'spread', 'binpack', found 'fast'\n"
        "  - max_placements_per_commit: expected an integer from 1 to 64 (128 etcd operations per "
        "transaction, 2 per placement), found 0"
    )


def test_weights_must_cover_every_priority_when_built_directly() -> None:
    with pytest.raises(ConfigError, match=r"priority_weights.low: expected a number > 0, found nothing"):
        SchedulerConfig(priority_weights={"high": 3.0, "normal": 1.0})


@pytest.mark.parametrize(
    "config",
    [
        SchedulerConfig(),
        SchedulerConfig(
            policy="binpack",
            priority_weights={"high": 5.0, "normal": 2.0, "low": 0.25},
            preemption_enabled_for=(),
            max_placements_per_commit=1,
            temperature_limit_c=95.0,
            advanced_profiling=True,
            profiling_interval_ms=5,
        ),
    ],
)
def test_yaml_round_trip(config: SchedulerConfig) -> None:
    assert parse_scheduler_config(to_yaml(config)) == config


def test_to_yaml_text() -> None:
    assert to_yaml(SchedulerConfig(priority_weights={"high": 3.0, "normal": 1.0, "low": 0.5})) == (
        "policy: spread\n"
        "priority_weights:\n"
        "  high: 3.0\n"
        "  normal: 1.0\n"
        "  low: 0.5\n"
        "min_gpu_utilization_threshold: 80.0\n"
        "temperature_limit_c: 85.0\n"
        "preemption_enabled_for:\n"
        "- high\n"
        "node_not_ready_grace_seconds: 8.0\n"
        "device_unhealthy_grace_seconds: 10.0\n"
        "pause_moves_not_ready_fraction: 0.5\n"
        "max_placements_per_commit: 50\n"
        "advanced_profiling: false\n"
        "profiling_interval_ms: 50\n"
    )


def test_config_is_immutable_and_hashable() -> None:
    c = SchedulerConfig()
    with pytest.raises(AttributeError):
        c.policy = "binpack"  # type: ignore[misc]
    with pytest.raises(TypeError):
        c.priority_weights["high"] = 1.0  # type: ignore[index]
    assert hash(c) == hash(SchedulerConfig())


def test_default_timings_fence_before_a_move_and_move_within_the_node_loss_budget() -> None:
    """The defaults' arithmetic (README "Node loss: the defaults and their arithmetic")."""
    from controlplane.settings import ReplicaSettings
    from node_agent.executor import fence
    from node_agent.settings import ExecutorSettings

    fields = ReplicaSettings.__dataclass_fields__
    lease = float(fields["node_lease_ttl_s"].default)  # type: ignore[arg-type]
    ack_window = float(fields["heartbeat_ack_requires_etcd_s"].default)  # type: ignore[arg-type]
    grace = SchedulerConfig().node_not_ready_grace_seconds
    ex = ExecutorSettings()
    # safety: the old engine is gone (last ack + deadline + slack + stop grace, the last ack at most
    # `ack_window` after the lease's last refresh) before the leader may move it (lease + grace)
    assert ack_window + ex.disconnect_stop_s + fence.FENCE_SLACK_S + ex.stop_grace_s < lease + grace
    assert ack_window > lease / 3  # above one refresh period, or acks would be withheld in steady state
    # an agent restart (a few seconds) never stops its engines
    assert ex.disconnect_stop_s >= 2 * fence.MIN_DEADLINE_S
    # speed: a frozen agent's lease is refreshed until its last heartbeat is lease/2 old, then
    # expires; + the grace + one scheduler tick must leave >= 2.5 s of the 20 s target for the engine
    assert lease * 1.5 + grace + 1.0 <= 20.0 - 2.5
