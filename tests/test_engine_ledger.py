"""The node-local safety pieces with real supervisor processes, without a cluster: the engine
ledger, self-fencing against the agent's lease file, device locks, and monotonic assignment sets."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kunlun_common.api import agent_pb2, workload_pb2
from kunlun_common.errors import PermanentError
from node_agent.executor import devlock, fence, ledger
from node_agent.executor.manager import ExecutorManager
from node_agent.executor.prepare import NodeContext
from node_agent.executor.sandbox import SandboxSettings
from node_agent.executor.supervisor_api import (
    SupervisorHandle,
    SupervisorSpec,
    adopt,
    launch,
    process_start_ticks,
    read_exit,
    stop,
)
from node_agent.settings import ExecutorSettings

ROOT = Path(__file__).resolve().parents[1]
NO_SANDBOX = SandboxSettings(pid_namespace=False, mount_namespace=False, private_tmp=False, private_dev=False)
SLEEPER = (sys.executable, "-c", "import time; time.sleep(120)")


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


def alive(pid: int | None) -> bool:
    return pid is not None and process_start_ticks(pid) is not None


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "agent"
    d.mkdir()
    yield d
    for inst in (d / "instances").glob("*"):
        handle = adopt(inst)
        if handle is not None:
            stop(handle, grace_s=0.2, timeout_s=5)


def spec(
    state: Path, name: str, devices: tuple[str, ...] = ("node-t/nvidia:0",), **kw: object
) -> SupervisorSpec:
    fields: dict[str, object] = {
        "instance_id": name,
        "instance_dir": state / "instances" / name,
        "argv": SLEEPER,
        "sandbox": NO_SANDBOX,
        "stop_grace_s": 2.0,
        "node": "node-t",
        "devices": devices,
        "agent_state_dir": str(state),
    }
    fields.update(kw)
    return SupervisorSpec(**fields)  # type: ignore[arg-type]


def events(state: Path) -> list[dict[str, object]]:
    return ledger.read(ledger.ledger_path(state))


def test_ledger_lines_from_concurrent_writers_stay_whole(tmp_path: Path) -> None:
    path = ledger.ledger_path(tmp_path)

    def writer(i: int) -> None:
        for j in range(50):
            ledger.append(path, ledger.event("start", "n", f"i{i}-{j}", ["n/nvidia:0"] * 20, j, "x" * 300))

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = path.read_text().splitlines()
    assert len(lines) == 200 and all(json.loads(line)["event"] == "start" for line in lines)
    path.open("a").write('{"torn": tru\n')  # a torn line is skipped, the rest is read
    assert len(ledger.read(path)) == 200 and len(ledger.read(path, tail=3)) == 3
    with pytest.raises(ValueError, match="exceeds"):
        ledger.append(path, ledger.event("stop", "n", "big", [], 1, "y" * 70000))


def test_supervisor_records_start_and_stop_around_the_engine(state: Path) -> None:
    h = launch(spec(state, "one"), 30)
    assert alive(h.engine_pid)
    start = events(state)[-1]
    assert (
        start["event"] == "start" and start["instance"] == "one" and start["devices"] == ["node-t/nvidia:0"]
    )
    assert start["boot_id"] == fence.boot_id() and set(start) == {
        "event", "node", "instance", "devices", "pid", "wall_ms", "mono_ns", "boot_id", "cause",
    }  # fmt: skip
    stop(h, grace_s=1.0, reason="stopped: no replica reachable for 5s (disconnect_stop_s=5)")
    end = events(state)[-1]
    assert end["event"] == "stop" and end["pid"] == start["pid"]
    # why it was stopped reaches the ledger (once "stopped"): a disconnect is told from a deletion
    assert str(end["cause"]).startswith("stopped: no replica reachable for 5s (disconnect_stop_s=5)"), end
    assert int(str(end["mono_ns"])) > int(str(start["mono_ns"]))


def test_engine_fences_itself_when_the_agent_stops_renewing(state: Path) -> None:
    lease = state / fence.FENCE_FILE
    fence.renew(lease, time.monotonic(), 60.0)
    h = launch(spec(state, "fenced", fence_deadline_s=3.0), 30)
    last_ack = time.monotonic()
    fence.renew(lease, last_ack, 3.0)  # the last acknowledged heartbeat: no renewal after this one
    wait_for(lambda: not alive(h.supervisor_pid), 20, "the supervisor to stop its engine by itself")
    took = time.monotonic() - last_ack
    assert took >= 3.0 + fence.FENCE_SLACK_S, took
    assert not alive(h.engine_pid)
    record = read_exit(h.instance_dir)
    assert record is not None and record.cause == "stopped" and "fenced" in record.message
    assert "fenced" in str(events(state)[-1]["cause"])


def test_renewed_lease_keeps_the_engine_and_an_expired_one_refuses_a_start(state: Path) -> None:
    lease = state / fence.FENCE_FILE
    fence.renew(lease, time.monotonic(), 60.0)
    h = launch(spec(state, "kept", fence_deadline_s=2.0), 30)
    end = time.monotonic() + 5.0
    while time.monotonic() < end:  # the agent renews: the engine keeps running past the deadline
        fence.renew(lease, time.monotonic(), 2.0)
        time.sleep(0.2)
    assert alive(h.engine_pid)
    stop(h, grace_s=1.0)
    fence.renew(lease, time.monotonic() - 10, 2.0)  # the agent has not been acknowledged for 10 s
    with pytest.raises(PermanentError, match="fenced"):
        launch(spec(state, "late", ("node-t/nvidia:1",), fence_deadline_s=2.0), 30)
    assert not [e for e in events(state) if e["instance"] == "late"], "no engine was started"


def test_device_lock_is_held_until_a_slow_engine_is_gone(state: Path) -> None:
    ready = state / "stubborn-ready"
    stubborn = (
        sys.executable,
        "-c",
        "import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "pathlib.Path(sys.argv[1]).touch(); time.sleep(120)",
        str(ready),
    )
    h = launch(spec(state, "old", argv=stubborn, stop_grace_s=2.0), 30)
    wait_for(ready.exists, 20, "the engine to ignore SIGTERM")
    lock_dir = state / devlock.LOCK_DIR
    assert devlock.busy(lock_dir, ["node-t/nvidia:0"]) == "node-t/nvidia:0"
    assert "instance old" in devlock.holder(lock_dir, "node-t/nvidia:0")
    assert devlock.busy(lock_dir, ["node-t/nvidia:1"]) is None
    stopper = threading.Thread(target=stop, args=(h, 8.0))  # SIGKILL after 8 s
    stopper.start()
    time.sleep(0.5)  # SIGTERM ignored: still the holder during its grace
    assert alive(h.engine_pid) and devlock.busy(lock_dir, ["node-t/nvidia:0"]) == "node-t/nvidia:0"
    with pytest.raises(PermanentError, match="still held by instance old"):
        launch(spec(state, "eager", device_wait_s=0.3), 30)
    stopper.join()
    assert not alive(h.engine_pid) and devlock.busy(lock_dir, ["node-t/nvidia:0"]) is None
    h2: SupervisorHandle = launch(spec(state, "new"), 30)
    runs = [e for e in events(state) if e["instance"] in ("old", "new")]
    old_stop = next(e for e in runs if e["instance"] == "old" and e["event"] == "stop")
    new_start = next(e for e in runs if e["instance"] == "new" and e["event"] == "start")
    assert int(str(old_stop["mono_ns"])) < int(str(new_start["mono_ns"]))
    stop(h2, grace_s=1.0)


def _manager(tmp_path: Path) -> ExecutorManager:
    ctx = NodeContext(
        node="node-t",
        address="127.0.0.1",
        instances_dir=tmp_path / "instances",
        cache_root=None,
        settings=ExecutorSettings(),
        sandbox=NO_SANDBOX,
        cgroups=False,
        devices=lambda: [],
        plugin=lambda t: None,
    )
    return ExecutorManager(ctx, [], lambda: 0.0)


def _set(revision: int, cluster_id: int, *iids: str) -> agent_pb2.Assignments:
    items = [
        agent_pb2.Assignment(
            instance_id=i, workload_id="w", spec=workload_pb2.WorkloadSpec(name="w", model="m")
        )
        for i in iids
    ]
    return agent_pb2.Assignments(items=items, revision=revision, cluster_id=cluster_id)


def test_assignment_sets_older_than_the_applied_one_are_ignored(tmp_path: Path) -> None:
    m = _manager(tmp_path)
    assert m.assign(_set(10, 7, "a", "b"))
    assert not m.assign(_set(9, 7, "a", "b", "gone-and-back")), "a lagging replica's older set"
    assert sorted(m.desired) == ["a", "b"]
    assert m.assign(_set(10, 7, "a", "b")), "the same revision again (another replica) is fine"
    assert m.assign(_set(12, 7, "a"))
    assert sorted(m.desired) == ["a"]
    assert m.assign(_set(3, 8, "c")), "a new etcd cluster id (restored from backup) resets the mark"
    assert sorted(m.desired) == ["c"] and (m.cluster_id, m.revision) == (8, 3)
    assert not m.assign(_set(2, 8))


def test_ledger_rpc_is_wrapped_and_listed() -> None:
    from controlplane.api.auth import PERMISSIONS
    from controlplane.api.ledger_service import LedgerService

    (service,) = [
        s for s in agent_pb2.DESCRIPTOR.services_by_name.values() if s.full_name == LedgerService.SERVICE
    ]
    for m in service.methods:
        assert getattr(getattr(LedgerService, m.name), "__rpc_method__", None) == m.name
        assert PERMISSIONS[f"/{service.full_name}/{m.name}"] == ("operator", "viewer", "replica")
    assert PERMISSIONS["/kunlun.v1.NodeService/Engines"] == ("replica",)


def test_runs_across_nodes_and_their_overlap(tmp_path: Path) -> None:
    """`runs_of` pairs each engine's start with its stop per node (other instances ignored, a run
    not stopped stays open); `overlap_s` is the longest time two runs were alive together."""
    a, b = tmp_path / "node-a", tmp_path / "node-b"
    s = 1_000_000_000

    def put(folder: Path, kind: str, inst: str, pid: int, at_s: float) -> None:
        ledger.append(
            ledger.ledger_path(folder), ledger.event(kind, folder.name, inst, ["d"], pid, "", int(at_s * s))
        )

    put(a, "start", "i-1", 10, 1.0)
    put(a, "start", "i-2", 11, 1.5)  # another instance: not counted
    put(a, "stop", "i-1", 10, 5.0)
    put(b, "start", "i-1", 20, 5.0)  # starts exactly when the old one stopped: no overlap
    runs = ledger.runs_of({"node-a": a, "node-b": b}, "i-1")
    assert sorted(runs) == [("node-a", 1 * s, 5 * s), ("node-b", 5 * s, ledger.OPEN)]
    assert ledger.overlap_s(runs) == 0
    put(a, "start", "i-1", 12, 6.0)  # a second engine while node-b's still runs (open)
    put(a, "stop", "i-1", 12, 8.5)
    runs = ledger.runs_of({"node-a": a, "node-b": b}, "i-1")
    assert len(runs) == 3 and ledger.overlap_s(runs) == 2.5
