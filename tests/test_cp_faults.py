"""Control-plane faults against one real cluster whose replicas' wall clocks disagree.

replica-1 runs 4 minutes behind, replica-2 4 minutes ahead (libfaketime, wall clock only: the
monotonic clock is the machine's), replica-3 on time, so every scenario here also runs under
skewed replica clocks. Each test tries to break the placement promise (at most one engine per
instance and per device, no move before the node grace as measured by the acting leader) with
real processes and real signals, and judges it from the nodes' engine ledgers.
"""

from __future__ import annotations

import glob
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from devcluster.cluster import LocalCluster
from devcluster.procs import ManagedProcess, pid_alive, wait_for
from kunlun_common.api import workload_pb2
from tests.fault_helpers import (
    agent_log,
    all_events,
    engine_run,
    events_of,
    fault_cluster,
    fencing_agent_args,
    leader,
    log_events,
    nodes_ready,
    overlaps,
    restore,
    running_on,
    stream_holder,
)
from tests.sched_helpers import call, get, set_config, submit, targets

LEASE_S, GRACE_S, DEADLINE_S, STOP_GRACE_S = 3, 5.0, 3.0, 2.0
FENCE_SLACK_S = 1.0  # node_agent/executor/fence.py
SKEW = {"replica-1": "-4m", "replica-2": "+4m"}
IGNORED = "ignoring an assignment set older than the one applied (a lagging replica)"


def faketime_lib() -> str:
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    assert found, "libfaketime is missing: `make install` installs the Debian package faketime"
    return found[0]


def skewed_env() -> dict[str, dict[str, str]]:
    lib = faketime_lib()
    return {
        name: {"LD_PRELOAD": lib, "FAKETIME": offset, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
        for name, offset in SKEW.items()
    }


@pytest.fixture(scope="module")
def cp_cluster() -> Iterator[LocalCluster]:
    """Short lease, grace, deadline and election TTL: 3 + 1 (slack) + 2 (fenced) < 3 + 5 (moved)."""
    with fault_cluster(
        "test_cp_faults",
        node_lease_ttl_s=LEASE_S,
        election_ttl_s=3,
        renew_deadline_s=2.0,
        retry_period_s=0.5,
        gateways=1,
        replica_env=skewed_env(),
        agent_args=fencing_agent_args(DEADLINE_S, STOP_GRACE_S),
    ) as c:
        set_config(c, f"node_not_ready_grace_seconds: {GRACE_S:g}\n")
        yield c


@pytest.fixture(autouse=True)
def clean(cp_cluster: LocalCluster) -> Iterator[None]:
    yield
    restore(cp_cluster)


# ---------------------------------------------------------------------------------------- helpers


def first_stamp(c: LocalCluster, replica: str) -> float:
    """Wall-clock time (by the replica's own clock) of the first line it logged."""
    from datetime import datetime

    for line in c.replicas[replica].log_text().splitlines():
        if line.startswith("{"):
            return datetime.fromisoformat(json.loads(line)["timestamp"]).timestamp()
    raise AssertionError(f"{replica} logged no JSON line")


def place_one(c: LocalCluster, name: str, **extra: Any) -> tuple[str, str, dict[str, Any]]:
    """Submit a 1-instance workload that may run on either node; (instance id, node, ledger start)."""
    submit(c, name=name, model="m", preferred_device_types=["cambricon", "ascend"], replicas=1, **extra)
    wait_for(lambda: running_on(c, name, "node-"), 120, f"{name} Running")
    inst = get(c, name).instances[0]
    run = engine_run(c, inst.node, inst.id)
    assert pid_alive(run["pid"])
    return inst.id, inst.node, run


def watch_move(c: LocalCluster, name: str, lost: str, timeout: float) -> tuple[float, float]:
    """Poll until the instance leaves `lost`: (last monotonic time it was seen still on `lost`,
    first time it was seen elsewhere). The move happened between the two."""
    end = time.monotonic() + timeout
    last_on = time.monotonic()
    while time.monotonic() < end:
        t = time.monotonic()
        try:
            where = targets(c, name)
        except RuntimeError:
            where = []
        if where and not where[0].startswith(f"{lost}/"):
            return last_on, time.monotonic()
        if where:
            last_on = t
        time.sleep(0.1)
    raise TimeoutError(f"{name} did not leave {lost} within {timeout}s")


def moved_reason(c: LocalCluster, name: str) -> float:
    """Seconds of NotReady the acting leader gave as its reason for the move."""
    reasons = [h.reason for i in get(c, name).instances for h in i.history]
    for r in reversed(reasons):
        m = re.search(r"NotReady for ([0-9.]+)s \(grace [0-9.]+s, as seen by this leader\)", r)
        if m:
            return float(m.group(1))
    raise AssertionError(f"no NotReady move reason in {reasons}")


def check_fenced_handover(c: LocalCluster, name: str, iid: str, lost: str, old: dict[str, Any]) -> None:
    """The instance serves on the other node; its old engine stopped by itself (fenced) before the
    replacement started; no two engines of one instance or on one device were ever alive at once."""
    other = next(n for n in c.node_names() if n != lost)
    wait_for(lambda: running_on(c, name, f"{other}/"), 120, f"{name} Running on {other}")
    stops = [e for e in events_of(c, lost, iid, "stop") if e["pid"] == old["pid"]]
    assert stops and "fenced" in stops[-1]["cause"], stops
    assert not pid_alive(old["pid"])
    new = engine_run(c, other, iid)
    assert stops[-1]["mono_ns"] < new["mono_ns"], (stops[-1], new)
    assert overlaps(all_events(c)) == []


# ------------------------------------------------------------------------------------------ tests


def test_skewed_replica_clocks_no_early_move_no_overlap(cp_cluster: LocalCluster) -> None:
    """Replicas ±4 minutes apart: the frozen node's liveness is written by one replica and judged
    by another (the leader). A leader that compared the writer's wall-clock stamp with its own clock
    would see the node NotReady for minutes and move at once; the move must wait the full grace."""
    c = cp_cluster
    # the skew is real: the replicas' first log lines (started within a second) are minutes apart
    first = {name: first_stamp(c, name) for name in c.replicas}
    assert abs(first["replica-1"] - first["replica-3"] + 240) < 30, first
    assert abs(first["replica-2"] - first["replica-3"] - 240) < 30, first
    iid, lost, old = place_one(c, "skew")
    # arrange: the frozen node's stream on one replica, the leader another (each pair of replicas
    # is at least 4 minutes apart); a graceful stop moves both the stream and the leadership
    for _ in range(8):
        holder, lead = stream_holder(c, lost), leader(c)
        if lead and holder != lead:
            break
        c.replicas[lead].stop()
        wait_for(lambda lead=lead: leader(c) not in ("", lead), 30, "a new leader")
        wait_for(lambda lead=lead: stream_holder(c, lost) != lead, 30, f"{lost} on another replica")
        c.restart_replica(lead)
        wait_for(lambda lead=lead: c.replica_serving(lead), 60, f"{lead} serving again")
        wait_for(lambda: running_on(c, "skew", f"{lost}/"), 30, "skew still Running")
    holder, lead = stream_holder(c, lost), leader(c)
    assert holder != lead, (holder, lead)
    agent = c.agents[lost]
    agent.pause()
    try:
        wait_for(lambda: not nodes_ready(c)[lost], 30, f"{lost} NotReady")
        not_ready_seen = time.monotonic()
        last_on, _ = watch_move(c, "skew", lost, 60)
        # the leader saw the node NotReady no earlier than the lease expired (< not_ready_seen)
        assert last_on - not_ready_seen >= GRACE_S - 1.0, (last_on - not_ready_seen, holder, lead)
        assert GRACE_S <= moved_reason(c, "skew") < GRACE_S + 10
        check_fenced_handover(c, "skew", iid, lost, old)
    finally:
        agent.resume()


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_stream_replica_lost_engine_keeps_running(cp_cluster: LocalCluster, how: str) -> None:
    """The replica holding an agent's stream killed (-9) or frozen (SIGSTOP, then the agent leaves
    it after its ack timeout): the agent registers with another replica in time, so its engine is
    neither stopped nor moved, and new assignments still reach it."""
    c = cp_cluster
    iid, node, old = place_one(c, "keep")
    holder = stream_holder(c, node)
    regs_before = len(log_events(agent_log(c, node), "registered with replica"))
    killed_at = time.monotonic()
    if how == "kill":
        c.replicas[holder].kill()
    else:
        c.replicas[holder].pause()  # resumed by the `clean` fixture
    wait_for(
        lambda: len(log_events(agent_log(c, node), "registered with replica")) > regs_before,
        30,
        f"{node} registered again",
    )
    assert stream_holder(c, node) != holder
    # a new workload pinned to a free device of that node: the new stream carries assignments
    free = next(
        d.name
        for d in c.devices()
        if d.name.startswith(f"{node}/") and d.name not in targets(c, "keep") and "nvidia" not in d.name
    )
    submit(c, name="later", model="m", pin=free, replicas=1)
    wait_for(lambda: running_on(c, "later", f"{node}/"), 120, "later Running")
    # observe past the point where a lost contact would have fenced the engine (deadline + slack +
    # stop grace) and the leader would have moved it (lease + grace)
    window = max(DEADLINE_S + FENCE_SLACK_S + STOP_GRACE_S, LEASE_S + GRACE_S) + 1.0
    while time.monotonic() - killed_at < window:
        assert pid_alive(old["pid"]), f"the engine stopped after its agent's replica was lost ({how})"
        time.sleep(0.2)
    assert pid_alive(old["pid"])
    assert events_of(c, node, iid, "stop") == []
    inst = get(c, "keep").instances[0]
    assert (inst.id, inst.node, inst.phase) == (iid, node, "Running")
    assert not [h for h in inst.history if "Rescheduled" in h.reason]
    assert overlaps(all_events(c)) == []


def test_leader_failover_inside_the_grace_restarts_it(cp_cluster: LocalCluster) -> None:
    """An agent frozen, its node NotReady, then the leader killed (-9) inside the grace. The new
    leader saw nothing of the node's past: it must wait a full grace of its own from when it took
    over (by then the node has been NotReady longer than the grace), never move earlier."""
    c = cp_cluster
    iid, lost, old = place_one(c, "fo")
    agent = c.agents[lost]
    agent.pause()
    try:
        wait_for(lambda: not nodes_ready(c)[lost], 30, f"{lost} NotReady")
        not_ready_seen = time.monotonic()
        old_leader = leader(c)
        assert old_leader
        c.replicas[old_leader].kill()
        killed_at = time.monotonic()
        assert killed_at - not_ready_seen < GRACE_S - 1.0, "too slow to fail over inside the grace"

        took_over = 0.0

        def new_leader() -> bool:
            nonlocal took_over
            if leader(c) not in ("", old_leader):
                took_over = time.monotonic()
                return True
            return False

        wait_for(new_leader, 30, "a new leader", interval=0.05)
        last_on, _ = watch_move(c, "fo", lost, 60)
        # NotReady for longer than the grace when the new leader took over, moved only after a
        # full grace from then
        assert last_on - took_over >= GRACE_S - 1.0, (last_on - took_over, last_on - not_ready_seen)
        assert last_on - not_ready_seen > GRACE_S
        assert GRACE_S <= moved_reason(c, "fo") < GRACE_S + 10
        check_fenced_handover(c, "fo", iid, lost, old)
    finally:
        agent.resume()


def engines_via_cli(c: LocalCluster, node: str, config: Path) -> list[dict[str, Any]]:
    """`kunlun-cli node engines NODE -o json`: the node's ledger read through the control plane."""
    r = subprocess.run(
        [sys.executable, "-m", "controlplane.cli.main", "node", "engines", node, "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"KUNLUN_CONFIG": str(config), "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stderr
    return list(json.loads(r.stdout)["items"])


def processes_naming(text: str) -> list[int]:
    """Live processes whose command line or environment names `text` (an instance id)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            seen = (d / "cmdline").read_bytes() + (d / "environ").read_bytes()
        except OSError:
            continue
        if text.encode() in seen and pid_alive(int(d.name)):
            found.append(int(d.name))
    return found


def test_lagging_replica_old_assignment_set_is_ignored(cp_cluster: LocalCluster, tmp_path: Path) -> None:
    """A replica whose watch lags (the failpoint holds its cache; its writes still work) pushes an
    assignment set older than the one the agent applied: the agent ignores it and says so, the
    removed instance does not come back (ledger, through `node engines`, and processes), and once
    the lag heals the agent converges to the current set."""
    from controlplane.cli.config import ClientConfig, write_client_config
    from controlplane.failpoints import ALLOW_FLAG, WATCH_HOLD_ENV
    from kunlun_common.pki import paths_for

    c = cp_cluster
    iid, node, old = place_one(c, "gone")
    holder, lead = stream_holder(c, node), leader(c)
    lag = next(r for r in c.replicas if r not in (holder, lead))
    hold = tmp_path / "hold-watch"
    # the lagging replica: started again with the failpoint (its own clock skew kept)
    c.replicas[lag].stop()
    proc = ManagedProcess(
        lag,
        [*c.replica_argv(lag, c.replica_addrs[lag]), ALLOW_FLAG],
        c.base / "replicas" / f"{lag}.log",
        env={**c.spec.replica_env.get(lag, {}), WATCH_HOLD_ENV: str(hold)},
    )
    proc.start()
    c.replicas[lag] = proc
    p = paths_for(c.cert_dir, "operator", "admin")
    cfg = tmp_path / "config.yaml"
    write_client_config(cfg, ClientConfig((c.replica_addrs[lag],), str(p.ca), str(p.cert), str(p.key)))
    try:
        _lag_and_heal(c, lag, hold, cfg, iid, node, old)
    finally:
        hold.unlink(missing_ok=True)
        # the replica runs again without the failpoint (the next tests must not inherit it)
        proc.stop()
        c.restart_replica(lag)


def _lag_and_heal(
    c: LocalCluster, lag: str, hold: Path, cfg: Path, iid: str, node: str, old: dict[str, Any]
) -> None:
    try:
        wait_for(lambda: c.replica_serving(lag), 60, f"{lag} serving with the failpoint")
        hold.touch()  # from here on, lag's cache (loaded at its start: gone is there) stays as it is
        # the removal, applied by the agent from an up-to-date replica: the engine stops
        call(c, lambda s: s.DeleteWorkload, workload_pb2.DeleteWorkloadRequest(name="gone"))
        wait_for(lambda: events_of(c, node, iid, "stop"), 60, "gone's engine stopped")
        assert not pid_alive(old["pid"])
        assert stream_holder(c, node) != lag
        applied = log_events(agent_log(c, node), "assignments received")[-1]["revision"]
        # every up-to-date replica killed: the agent's only way back is the lagging one
        regs = len(log_events(agent_log(c, node), "registered with replica"))
        for name, r in c.replicas.items():
            if name != lag:
                r.kill()
        wait_for(
            lambda: (
                len(log_events(agent_log(c, node), "registered with replica")) > regs
                and stream_holder(c, node) == lag
            ),
            60,
            f"{node} registered with {lag}",
        )

        def outcome() -> bool:
            return bool(log_events(agent_log(c, node), IGNORED)) or len(events_of(c, node, iid, "start")) > 1

        wait_for(outcome, 60, "the old set ignored (or applied)")
        assert len(events_of(c, node, iid, "start")) == 1, "the removed instance came back"
        ignored = log_events(agent_log(c, node), IGNORED)
        assert ignored and ignored[-1]["revision"] < ignored[-1]["applied_revision"] == applied, ignored
        # nothing of the removed instance runs: the ledger read through the (lagging) control plane,
        # and the processes
        mine = [e for e in engines_via_cli(c, node, cfg) if e["instance"] == iid]
        assert [e["event"] for e in mine] == ["start", "stop"], mine
        assert processes_naming(iid) == []
        # a workload submitted during the lag, pinned to a free device of that node: only the
        # current set has it
        free = next(
            d.name
            for d in c.devices()
            if d.name.startswith(f"{node}/") and d.name not in old["devices"] and "nvidia" not in d.name
        )
        submit(c, name="later", model="m", pin=free, replicas=1)
        for name in c.replicas:
            if name != lag:
                c.restart_replica(name)
    finally:
        hold.unlink(missing_ok=True)  # the lag heals
    wait_for(lambda: running_on(c, "later", f"{node}/"), 120, "later Running once the lag healed")
    assert stream_holder(c, node) == lag
    assert log_events(agent_log(c, node), "assignments received")[-1]["revision"] > applied
    assert len(events_of(c, node, iid, "start")) == 1 and processes_naming(iid) == []
    assert overlaps(all_events(c)) == []


def chat(gateway: str, model: str, timeout: float = 5.0) -> int:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    req = urllib.request.Request(
        f"http://{gateway}/v1/chat/completions", body.encode(), {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


def test_control_plane_outage_available_serves_strict_fences(cp_cluster: LocalCluster) -> None:
    """Two whole-control-plane outages under gateway traffic: every replica frozen, then etcd
    without quorum (2 of its 3 members killed; the replicas then withhold heartbeat acks). The
    `available` workload keeps serving with no failed request (the gateway keeps its last
    endpoints, the engine is never fenced); the `strict` one stops at its disconnect deadline and
    serves again once the control plane is back."""
    c = cp_cluster
    av_id, _, av_old = place_one(c, "av", fencing="available")
    place_one(c, "st")
    gw = next(iter(c.gateway_addrs.values()))
    wait_for(lambda: chat(gw, "av") == 200 and chat(gw, "st") == 200, 30, "the gateway routes to both")
    statuses: list[int] = []
    lost = c.etcd.members[1:]

    def freeze() -> None:
        for r in c.replicas.values():
            r.pause()

    def thaw() -> None:
        for r in c.replicas.values():
            r.resume()

    def quorum_lost() -> None:
        for m in lost:
            m.proc.kill()

    def quorum_back() -> None:
        for m in lost:
            m.proc.start()

    figures = [
        outage(c, gw, statuses, "every replica frozen", freeze, thaw),
        outage(c, gw, statuses, "etcd quorum lost", quorum_lost, quorum_back),
    ]
    print("; ".join(figures), f"; {len(statuses)} requests to the available workload")
    failed = [s for s in statuses if s != 200]
    assert not failed, f"{len(failed)} of {len(statuses)} requests to the available workload failed"
    assert len(statuses) >= 100
    assert pid_alive(av_old["pid"]), "the available engine was stopped by an outage"
    # one strict engine at a time; no device ever shared
    assert overlaps(all_events(c), per_instance=lambda i: i != av_id) == []


def outage(
    c: LocalCluster,
    gw: str,
    statuses: list[int],
    what: str,
    begin: Callable[[], None],
    end: Callable[[], None],
) -> str:
    """One outage with requests to `av` all along: the strict engine of `st` stops at its deadline
    and `st` serves again after `end`. Returns the figures."""

    def traffic(n: int) -> None:
        statuses.extend(chat(gw, "av") for _ in range(n))

    inst = get(c, "st").instances[0]
    run = engine_run(c, inst.node, inst.id)
    begin()
    began = time.monotonic()
    try:
        stops: list[dict[str, Any]] = []
        for _ in range(3000):  # bounded in count and time; paced so the count outlasts 60 s
            traffic(2)
            stops = [e for e in events_of(c, inst.node, inst.id, "stop") if e["pid"] == run["pid"]]
            if stops or time.monotonic() - began > 60:
                break
            time.sleep(0.02)
        assert stops, f"{what}: the strict engine was not stopped"
        stopped_after = time.monotonic() - began
        # stopped by its agent at the deadline (it is alive, so it does it in order; its
        # supervisor's fence is the backstop for a frozen or dead agent)
        assert stops[-1]["cause"].startswith("stopped: no replica reachable for"), stops[-1]
        assert not pid_alive(run["pid"])
        # the deadline counts from the last acknowledged heartbeat, at most an interval before
        assert stopped_after >= DEADLINE_S - 1.0, (what, stopped_after)
        # the strict workload is gone from the data plane meanwhile; the available one serves on
        traffic(20)
        assert chat(gw, "st") != 200
    finally:
        end()
    ended = time.monotonic()
    recovered = False
    for _ in range(3000):  # about 0.05 s a round at least: the count outlasts 120 s
        traffic(2)
        recovered = running_on(c, "st", "node-") and chat(gw, "st") == 200
        if recovered or time.monotonic() - ended > 120:
            break
        time.sleep(0.02)
    assert recovered, (what, [(i.phase, i.reason) for i in get(c, "st").instances])
    return f"{what}: strict stopped after {stopped_after:.1f}s, serving {time.monotonic() - ended:.1f}s after"
