"""The fencing inequality and the bounded workload record, as pure functions: the edges of
`disconnect deadline + stop grace < node lease + not-ready grace` where each number enters (agent
start-up, registration, `scheduler config set` against the registered nodes), and the history cap
with its per-phase counts. The same refusals through real processes: tests/test_node_faults.py and
tests/test_placement_safety.py."""

from __future__ import annotations

import pytest

from controlplane.fencing import fencing_problem, node_problems
from controlplane.workloads.records import MAX_HISTORY, MAX_RECORD_BYTES, add_history, encode_checked
from kunlun_common.api import types_pb2, workload_pb2
from kunlun_common.errors import ConfigError, PermanentError
from node_agent.agent import DEFAULT_NODE_GRACE_S, DEFAULT_NODE_LEASE_S, check_fencing
from node_agent.executor import fence
from node_agent.settings import AgentSettings, ExecutorSettings


def test_the_rule_is_strict_and_names_every_number() -> None:
    assert fencing_problem("n", 4, 3, 3, 5) is None  # 7 < 8
    problem = fencing_problem("n", 5, 3, 3, 5)  # 8 is not below 8: an engine could outlive the move
    assert problem is not None
    assert str(problem).startswith(
        "node n: disconnect deadline 5s + stop grace 3s = 8s is not below node lease 3s + "
        "node_not_ready_grace_seconds 5s = 8s"
    )
    text = str(problem)
    assert "--disconnect-stop" in text and "node_not_ready_grace_seconds" in text.split("; ")[-1]
    assert fencing_problem("n", 0, 30, 1, 1) is None, "an agent that does not fence itself is not checked"


def test_config_set_checks_each_node_with_its_recorded_lease() -> None:
    nodes = [
        types_pb2.Node(name="fast", disconnect_deadline_s=4, stop_grace_s=3, lease_ttl_s=3),
        types_pb2.Node(name="slow", disconnect_deadline_s=7, stop_grace_s=5, lease_ttl_s=3),
        types_pb2.Node(name="old-agent", lease_ttl_s=3),  # registered before agents reported fencing
    ]
    assert node_problems(nodes, 10.0) == []
    (slow,) = node_problems(nodes, 8.0)
    assert str(slow).startswith("node slow: disconnect deadline 7s + stop grace 5s = 12s")
    assert len(node_problems(nodes, 4.0)) == 2
    assert node_problems(nodes, 8.0, lease_ttl_s=5) == [], "a replica's own lease TTL when given"


def _agent(deadline: float, grace: float) -> AgentSettings:
    """An agent whose replica failover (ack timeout + heartbeat interval + 1 s) fits the shortest
    deadline, so only the deadline and grace rules under test decide."""
    ex = ExecutorSettings(disconnect_stop_s=deadline, stop_grace_s=grace)
    return AgentSettings(
        config_path="n.yaml",
        endpoints=("r:1",),
        cert_dir="c",
        state_dir="s",
        executor=ex,
        ack_timeout_s=0.5,
        heartbeat_interval_s=0.5,
    )


def test_agent_start_up_edges() -> None:
    check_fencing(_agent(fence.MIN_DEADLINE_S, 3.0))
    with pytest.raises(ConfigError, match="shorter than an agent restart"):
        check_fencing(_agent(fence.MIN_DEADLINE_S - 0.5, 3.0))
    limit = DEFAULT_NODE_LEASE_S + DEFAULT_NODE_GRACE_S
    ok = limit - fence.FENCE_SLACK_S - 3.0 - 0.5
    check_fencing(_agent(ok, 3.0))
    with pytest.raises(ConfigError) as err:
        check_fencing(_agent(ok + 0.5, 3.0))  # exactly the limit: refused
    assert f"= {limit:g}s is not below the default node lease" in str(err.value)


def test_history_keeps_the_last_entries_and_counts_the_rest_per_phase() -> None:
    w = workload_pb2.Workload(id="w-1", spec=workload_pb2.WorkloadSpec(name="w", model="m"))
    sizes = []
    for i in range(1000):
        phase = "Updated" if i % 3 else f"Scaled to {i % 2}"
        add_history(w, workload_pb2.PhaseEvent(phase=phase, at_unix_ms=i, by="op", reason=f"r{i}"))
        sizes.append(len(encode_checked(w)))
    assert len(w.history) == MAX_HISTORY and [h.at_unix_ms for h in w.history] == list(range(950, 1000))
    assert sum(w.history_dropped.values()) == 950
    assert w.history_dropped["Updated"] == sum(1 for i in range(950) if i % 3)
    assert max(sizes[200:]) - min(sizes[200:]) < 64, "the record stops growing once the cap is reached"


def test_an_oversized_record_is_refused_with_its_size() -> None:
    w = workload_pb2.Workload(
        id="w-1", spec=workload_pb2.WorkloadSpec(name="big", model="m", env={"X": "y" * MAX_RECORD_BYTES})
    )
    with pytest.raises(PermanentError, match=r"workload 'big': the record would be \d+ bytes, over the"):
        encode_checked(w)
