"""Executors end to end: real agents run what the scheduler assigns, in real sandboxes and cgroups.

One local cluster for the module (3 etcd members, 3 replicas, agents for node-a and node-b) whose
agents run with `--test-engine-fallback` (SGLang is not installed here: kunlun-test-engine serves
`engine: sglang` workloads with the same arguments), fast probes and back-off, and a short
`--disconnect-stop`. A third agent (node-c) reaches the replicas only through TCP proxies the test
can cut. Every workload is pinned to a device so the tests do not disturb each other.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from devcluster.cluster import LocalCluster
from devcluster.procs import ManagedProcess, free_port, pid_alive, wait_for
from kunlun_common.api import (
    agent_pb2,
    agent_pb2_grpc,
    cluster_pb2,
    types_pb2,
    workload_pb2,
    workload_pb2_grpc,
)
from kunlun_common.pki import paths_for
from kunlun_common.tls import channel_credentials, load_tls
from node_agent.executor.cgroups import InstanceCgroup, detect_layout, remove_parent_if_empty
from node_agent.executor.manager import stop_all_instances
from node_agent.executor.supervisor_api import read_state
from tests.conftest import FAST_TMP, LOG_KEEP, start_cluster
from tests.sched_helpers import call, get, submit, workloads

LAYOUT = detect_layout()
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or LAYOUT.memory is None,
    reason="needs root, util-linux unshare and a memory cgroup controller",
)
AGENT_SECRET = "KUNLUN_TEST_AGENT_SECRET"
DISCONNECT_STOP_S = 8.0
"""Long enough for a killed agent to be restarted and reach a replica on a loaded 2-core box (agent
start-up now probes the engine protections too), so its adopted engines are not fenced meanwhile."""
AGENT_ARGS = (
    "--test-engine-fallback",
    "--probe-interval=0.2",
    "--probe-failures=3",
    "--restart-backoff=0.3",
    "--restart-backoff-max=2",
    f"--disconnect-stop={DISCONNECT_STOP_S:g}",
    "--stop-grace=3",
)
NODE_C = """\
schema_version: 1
node:
  name: node-c
  address: 127.0.0.1
  simulated: true
  health_interval_seconds: 1.0
devices:
  - device_type: nvidia
    device_id: 0
    model: A100-SXM4-40GB
    total_memory_mb: 40960
    hbm_memory_mb: 40960
    fp16_compute_power_tflops: 312
    bf16_compute_power_tflops: 312
    supported_dtypes: [fp16, bf16]
"""


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    """This module's own cluster (see the module docstring); agents inherit AGENT_SECRET."""
    base = Path(tempfile.mkdtemp(prefix="kunlun-exec-", dir=FAST_TMP))
    _BASES.append(base)
    os.environ[AGENT_SECRET] = "must-not-reach-engines"
    try:
        c = start_cluster(base, agent_args=AGENT_ARGS, extra_nodes=("node-x", "node-c"))
    finally:
        del os.environ[AGENT_SECRET]
    try:
        yield c
    finally:
        for name in _workload_names(c):
            _safe(lambda name=name: _delete(c, name))
        c.stop()
        for d in base.glob("agents/*/instances"):
            stop_all_instances(d, grace_s=2.0)
            remove_parent_if_empty(LAYOUT, f"kunlun/{d.parent.name}")
        remove_parent_if_empty(LAYOUT, "kunlun")
        keep = LOG_KEEP / "test_cluster_executor"
        shutil.rmtree(keep, ignore_errors=True)
        for log in [*base.glob("replicas/*.log"), *base.glob("agents/*/agent.log")]:
            dest = keep / log.relative_to(base)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(log, dest)
        shutil.rmtree(base, ignore_errors=True)


def _workload_names(c: LocalCluster) -> list[str]:
    try:
        return [w.workload.spec.name for w in workloads(c)]
    except Exception:
        return []


def _safe(fn: object) -> object:
    assert callable(fn)
    try:
        return fn()
    except Exception:
        return None


# ------------------------------------------------------------------------------------ helpers


def _delete(cluster: LocalCluster, name: str) -> None:
    call(cluster, lambda s: s.DeleteWorkload, workload_pb2.DeleteWorkloadRequest(name=name))


def instance(cluster: LocalCluster, name: str) -> workload_pb2.Instance:
    insts = get(cluster, name).instances
    assert len(insts) == 1, insts
    return insts[0]


def running(cluster: LocalCluster, name: str, timeout: float = 30, **want: object) -> workload_pb2.Instance:
    """Wait until the workload's one instance is Running with an endpoint (and the `want` fields)."""
    found: list[workload_pb2.Instance] = []

    def check() -> bool:
        i = instance(cluster, name)
        if i.phase == "Running" and i.endpoint and i.pid and all(getattr(i, k) == v for k, v in want.items()):
            found.append(i)
            return True
        return False

    wait_for(check, timeout, f"{name} Running", interval=0.1)
    return found[-1]


def http(endpoint: str, path: str, body: dict[str, object] | None = None) -> tuple[int, dict[str, object]]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://{endpoint}{path}", data=data, method="POST" if data else "GET")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=5) as resp:
        return resp.status, json.loads(resp.read() or b"{}")


def logs(cluster: LocalCluster, name: str, tail: int = 0) -> list[str]:
    """The instance's log lines through the control plane (WorkloadService.Logs -> the node's agent)."""
    req = workload_pb2.WorkloadLogsRequest(name=name, tail=tail)
    for replica, addr in cluster.replica_addrs.items():
        if not cluster.replicas[replica].alive():
            continue
        with cluster.channel(addr) as ch:
            try:
                return [
                    line
                    for c in workload_pb2_grpc.WorkloadServiceStub(ch).Logs(req, timeout=15)
                    for line in c.lines
                ]
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
    raise AssertionError("no replica served the logs")


def instance_dir(cluster: LocalCluster, node: str, iid: str) -> Path:
    return cluster.base / "agents" / node / "instances" / iid


_BASES: list[Path] = []


def engine_pids(served_name: str) -> list[int]:
    """Host pids of the test engines serving `served_name` (found by command line)."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[1:3] == [b"-m", b"node_agent.testengine"] and served_name.encode() in argv:
            try:  # only this module's engines (a demo cluster on the same machine may serve the same names)
                if _BASES and not os.readlink(p / "cwd").startswith(str(_BASES[-1])):
                    continue
            except OSError:
                continue
            out.append(int(p.name))
    return out


def nodes(cluster: LocalCluster) -> dict[str, types_pb2.Node]:
    resp = cluster.call_any("ListNodes", cluster_pb2.ListNodesRequest())
    assert isinstance(resp, cluster_pb2.ListNodesResponse)
    return {n.name: n for n in resp.nodes}


class Proxy:
    """A TCP proxy to one replica that the test can cut (close everything) and restore."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.port = free_port()
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        self.listener: socket.socket | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        lsock = socket.create_server(("127.0.0.1", self.port))
        lsock.settimeout(0.1)
        self.listener = lsock
        threading.Thread(target=self._accept, args=(lsock,), daemon=True).start()

    def _accept(self, lsock: socket.socket) -> None:
        while self.listener is lsock:
            try:
                client, _ = lsock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=2)
            except OSError:
                client.close()
                continue
            client.settimeout(None)
            upstream.settimeout(None)
            with self.lock:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        lsock, self.listener = self.listener, None
        if lsock is not None:
            lsock.close()
        with self.lock:
            conns, self.conns = self.conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def seqs(lines: list[str]) -> list[int]:
    return [int(m.group(1)) for line in lines if (m := re.search(r"kunlun-test-engine log seq=(\d+) ", line))]


CHAT: dict[str, object] = dict(
    name="chat",
    model="demo-model",
    devices_per_instance=1,
    memory_per_device_mb=1000,
    replicas=1,
    pin="node-a/ascend:0",
    env={"KUNLUN_TEST_SPEC_VAR": "from-the-spec"},
)
CHATTY: dict[str, object] = dict(
    name="chatty",
    model="demo-model",
    devices_per_instance=1,
    memory_per_device_mb=1000,
    replicas=1,
    pin="node-a/ascend:1",
    engine_args=["--log-lines-per-second", "200"],
)


def serving(cluster: LocalCluster, spec: dict[str, object]) -> workload_pb2.Instance:
    """The workload of `spec` Running, submitted if this test is the first to need it (submitting
    an unchanged spec changes nothing), so that every test runs alone and in any order."""
    submit(cluster, **spec)
    return running(cluster, str(spec["name"]))


def restart_agent(cluster: LocalCluster, node: str) -> None:
    """Start the node's agent again, with the environment the fixture gave the first one."""
    os.environ[AGENT_SECRET] = "must-not-reach-engines"
    try:
        cluster.start_agent(cluster.spec.node_configs[cluster.node_names().index(node)], node)
    finally:
        del os.environ[AGENT_SECRET]


# ------------------------------------------------------------------------------------ tests


def test_assigned_instance_runs_sandboxed_and_answers(cluster: LocalCluster) -> None:
    inst = serving(cluster, CHAT)
    assert "kunlun-test-engine" in inst.reason and "SGLang is not installed on node-a" in inst.reason
    status, body = http(
        inst.endpoint,
        "/v1/chat/completions",
        {"model": "chat", "messages": [{"role": "user", "content": "hi"}]},
    )
    choices = body["choices"]
    assert status == 200 and isinstance(choices, list) and choices[0]["message"]["role"] == "assistant"
    # the launch plan, with env names only
    assert "node_agent.testengine" in inst.launch_command and "--served-model-name" in inst.launch_command
    assert (
        "ASCEND_RT_VISIBLE_DEVICES" in inst.launch_env_names
        and "KUNLUN_TEST_SPEC_VAR" in inst.launch_env_names
    )
    assert AGENT_SECRET not in inst.launch_env_names
    assert "/dev/davinci0" in inst.launch_device_nodes and inst.prepare_seconds > 0
    wait_for(lambda: instance(cluster, "chat").first_token_ms > 0, 10, "first-token time reported")
    # the engine's real environment: the agent's secret is absent, the spec's and the plugin's are there
    _, env = http(inst.endpoint, "/debug/env")
    names = env["env_names"]
    assert isinstance(names, list)
    assert (
        AGENT_SECRET not in names and "KUNLUN_TEST_SPEC_VAR" in names and "ASCEND_RT_VISIBLE_DEVICES" in names
    )
    assert AGENT_SECRET.encode() not in Path(f"/proc/{inst.pid}/environ").read_bytes()
    assert AGENT_SECRET.encode() in Path(f"/proc/{cluster.agents['node-a'].pid}/environ").read_bytes()
    # in its own cgroup (memory, pids, cpu) and PID namespace
    cgroups = Path(f"/proc/{inst.pid}/cgroup").read_text()
    assert f"kunlun/node-a/{inst.id}" in cgroups
    assert os.readlink(f"/proc/{inst.pid}/ns/pid") != os.readlink("/proc/self/ns/pid")
    # the node reports its protections; the simulated chip shows the engine's memory
    protections = set(nodes(cluster)["node-a"].protections)
    assert {"cgroup-memory", "pid-namespace", "private-dev"} <= protections
    # unprivileged by default: the engine user, no capabilities, no_new_privs, seccomp, read-only host
    assert {
        "engine-user:kunlun-engine",
        "no-capabilities",
        "no-new-privs",
        "seccomp",
        "read-only-root",
        "hidden-agent-folders",
    } <= protections
    assert not [p for p in protections if p.startswith("off:")], protections
    proc_status = dict(
        line.split(":", 1) for line in Path(f"/proc/{inst.pid}/status").read_text().splitlines()
    )
    assert proc_status["Uid"].split()[0] == str(pwd.getpwnam("kunlun-engine").pw_uid)
    assert proc_status["NoNewPrivs"].strip() == "1" and proc_status["Seccomp"].strip() == "2"
    assert int(proc_status["CapEff"], 16) == 0 and int(proc_status["CapBnd"], 16) == 0
    wait_for(
        lambda: any(
            d.name == "node-a/ascend:0" and d.telemetry.memory_used_mb == 1000 for d in cluster.devices()
        ),
        20,
        "the simulated chip to show the engine's memory",
    )


def test_killed_engine_is_restarted(cluster: LocalCluster) -> None:
    before = serving(cluster, CHAT)
    os.kill(before.pid, signal.SIGKILL)

    def restarted() -> bool:
        i = instance(cluster, "chat")
        return i.phase == "Running" and i.pid not in (0, before.pid) and i.restarts >= 1

    wait_for(restarted, 30, "chat restarted and Running again")
    after = instance(cluster, "chat")
    assert after.endpoint == before.endpoint and engine_pids("chat") == [after.pid]
    assert "restarting after back-off" in cluster.agents["node-a"].log_text()
    status, _ = http(after.endpoint, "/v1/completions", {"model": "chat", "prompt": "again", "max_tokens": 2})
    assert status == 200


def test_engine_over_its_memory_limit_is_oom_killed(cluster: LocalCluster) -> None:
    submit(
        cluster,
        name="hog",
        model="demo-model",
        devices_per_instance=1,
        memory_per_device_mb=1000,
        replicas=1,
        pin="node-b/cambricon:0",
        env={"KUNLUN_MEMORY_LIMIT_MB": "128"},
        engine_args=["--memory-mb", "512"],
    )
    seen: list[workload_pb2.Instance] = []

    def oom_killed() -> bool:
        seen.append(instance(cluster, "hog"))
        return seen[-1].reason.startswith("OOMKilled")

    wait_for(oom_killed, 30, "hog reported OOMKilled")
    assert seen[-1].phase == "CrashLoopBackOff" and seen[-1].exit_code == 137, seen[-1]
    assert not any(i.phase == "Running" for i in seen)
    wait_for(lambda: instance(cluster, "hog").restarts >= 2, 30, "hog restarted with back-off")
    _delete(cluster, "hog")
    wait_for(lambda: not engine_pids("hog"), 20, "hog's engine gone")


def test_logs_come_through_the_control_plane(cluster: LocalCluster) -> None:
    serving(cluster, CHAT)
    lines = logs(cluster, "chat")
    assert any("kunlun-test-engine ready on" in line for line in lines), lines[-20:]
    assert len(logs(cluster, "chat", tail=1)) == 1


def test_node_service_serves_replicas_only(cluster: LocalCluster) -> None:
    inst = serving(cluster, CHAT)
    node = nodes(cluster)["node-a"]
    req = agent_pb2.LogsRequest(instance_id=inst.id, tail=5)
    for role, name, ok in (
        ("replica", "replica-1", True),
        ("operator", "admin", False),
        ("agent", "node-b", False),
    ):
        creds = channel_credentials(load_tls(paths_for(cluster.cert_dir, role, name)), server_role="agent")
        with grpc.secure_channel(
            node.node_service, creds, options=[("grpc.ssl_target_name_override", "node-a")]
        ) as ch:
            stub = agent_pb2_grpc.NodeServiceStub(ch)
            if ok:
                assert len([line for c in stub.Logs(req, timeout=10) for line in c.lines]) == 5
                with pytest.raises(grpc.RpcError) as e:
                    list(stub.Logs(agent_pb2.LogsRequest(instance_id="../etc"), timeout=10))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            else:
                with pytest.raises(grpc.RpcError) as e:
                    list(stub.Logs(req, timeout=10))
                # the NodeService trusts only the replica CA: refused in the TLS handshake
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE, role


def test_agent_killed_and_restarted_adopts_its_engines(cluster: LocalCluster) -> None:
    chatty = serving(cluster, CHATTY)
    chat = serving(cluster, CHAT)
    log_file = instance_dir(cluster, "node-a", chatty.id) / "engine.log"
    agent = cluster.agents["node-a"]
    agent.kill()
    written = len(seqs(log_file.read_text().splitlines()))
    wait_for(
        lambda: len(seqs(log_file.read_text().splitlines())) > written + 200,
        10,
        "the engine to keep logging without its agent",
    )
    assert pid_alive(chatty.pid) and pid_alive(chat.pid)
    restart_agent(cluster, "node-a")
    wait_for(lambda: "adopting engine" in cluster.agents["node-a"].log_text(), 30, "the new agent to adopt")
    again = running(cluster, "chatty", timeout=30)
    assert again.pid == chatty.pid and again.restarts == chatty.restarts
    assert running(cluster, "chat").pid == chat.pid
    assert engine_pids("chatty") == [chatty.pid], "exactly one copy of the engine"
    lines = logs(cluster, "chatty")
    got = seqs(lines)
    assert got == list(range(len(got))) and len(got) > written + 200, "no log line lost or duplicated"
    # following: the lines after the last one kept, in order, through the control plane
    req = workload_pb2.WorkloadLogsRequest(name="chatty", tail=1, follow=True)
    with cluster.channel(cluster.endpoints[0]) as ch:
        stream = workload_pb2_grpc.WorkloadServiceStub(ch).Logs(req, timeout=20)
        followed: list[int] = []
        for chunk in stream:
            followed.extend(seqs(list(chunk.lines)))
            if len(followed) > 50:
                break
    assert followed == list(range(followed[0], followed[0] + len(followed))) and followed[0] >= got[-1]


def test_agent_cut_off_from_every_replica_stops_its_engines(cluster: LocalCluster, tmp_path: Path) -> None:
    config = tmp_path / "node-c.yaml"
    config.write_text(NODE_C)
    proxies = [Proxy(ep) for ep in cluster.endpoints]
    for p in proxies:
        p.start()
    argv = [a for a in cluster.agent_argv(config, "node-c") if not a.startswith("--endpoints=")]
    argv.append("--endpoints=" + ",".join(p.address for p in proxies))
    agent = ManagedProcess("agent-node-c", argv, cluster.base / "agents" / "node-c" / "agent.log")
    agent.start()
    cluster.agents["node-c"] = agent
    try:
        wait_for(lambda: cluster.node_ready("node-c"), 30, "node-c registered")
        submit(
            cluster,
            name="edge",
            model="demo-model",
            devices_per_instance=1,
            memory_per_device_mb=1000,
            replicas=1,
            pin="node-c/nvidia:0",
        )
        edge = running(cluster, "edge")
        cut_at = time.monotonic()
        for p in proxies:
            p.cut()
        wait_for(lambda: not pid_alive(edge.pid), DISCONNECT_STOP_S + 15, "node-c to stop its engine")
        # the delay counts from the last acknowledged heartbeat (up to one interval, 1 s, before the cut)
        elapsed = time.monotonic() - cut_at
        assert elapsed >= DISCONNECT_STOP_S - 1.5, f"stopped {elapsed:.1f}s after the cut"
        event = next(
            json.loads(line)
            for line in agent.log_text().splitlines()
            if "no replica reachable: stopping every engine" in line
        )
        assert event["since_s"] >= DISCONNECT_STOP_S and event["engines"] == 1, event
        for p in proxies:
            p.start()
        wait_for(
            lambda: "no replica reachable" in nodes(cluster)["node-c"].note, 30, "the note after reconnect"
        )
        # the status the agent wrote before the cut may still be read until it reports again:
        # wait for a Running report from a new, live engine
        wait_for(
            lambda: (lambda i: i.phase == "Running" and i.pid != edge.pid and pid_alive(i.pid))(
                instance(cluster, "edge")
            ),
            30,
            "edge Running again on a new engine",
            interval=0.1,
        )
    finally:
        _safe(lambda: _delete(cluster, "edge"))
        wait_for(lambda: not engine_pids("edge"), 20, "edge's engine gone")
        agent.stop()
        for p in proxies:
            p.cut()


def test_deleted_workloads_leave_no_process_cgroup_or_dir(cluster: LocalCluster) -> None:
    gone = []
    for spec in (CHAT, CHATTY):
        inst = serving(cluster, spec)
        d = instance_dir(cluster, "node-a", inst.id)
        state = read_state(d)
        assert state is not None
        gone.append((inst, d, int(state["supervisor_pid"])))
    for name in ("chat", "chatty"):
        _delete(cluster, name)
    for inst, d, sup in gone:
        cg = InstanceCgroup(LAYOUT, inst.id, "kunlun/node-a")
        wait_for(
            lambda inst=inst, d=d, sup=sup, cg=cg: (
                not pid_alive(inst.pid) and not pid_alive(sup) and not cg.exists() and not d.exists()
            ),
            20,
            f"{inst.workload}'s engine, supervisor, cgroup and dir gone",
        )
    wait_for(lambda: not workloads(cluster), 30, "workloads deleted")
