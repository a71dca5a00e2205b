"""One chaos run, from inside the topology's client namespace (`kunlun-chaos run` starts it there):
start the cluster on its hosts, start the load, apply the seeded fault schedule with heal steps,
let it converge, read the whole etcd history and the engine ledgers, check, report.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import random
import re
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from chaos import report
from chaos.checkers import (
    Observation,
    Verdict,
    check_allocations,
    check_convergence,
    check_engines,
    check_fencing,
    check_linearizable,
    check_lost_writes,
    check_serving,
    not_converged,
)
from chaos.clients import SERVE_WORKLOAD
from chaos.etcdhist import EtcdHistory, read_history
from chaos.faults import KINDS, Injector, schedule
from chaos.history import FaultRecord, RunHistory, Sample, read_jsonl
from chaos.netcluster import NetCluster, net_cluster
from devcluster.procs import wait_for
from kunlun_common.api import cluster_pb2, cluster_pb2_grpc, workload_pb2, workload_pb2_grpc
from kunlun_common.pki import etcd_client_paths
from kunlun_common.states import InstancePhase


@dataclass(frozen=True)
class Profile:
    """How long and hard a run is."""

    faults: int
    """Number of faults, applied one after another."""
    gap_s: float
    """Quiet seconds between a heal and the next fault."""
    settle_s: float
    """At most this long after a heal, wait for the cluster to have a leader again."""
    convergence_bound_s: float
    """Everything must agree within this long after the last heal."""


PROFILES = {
    "short": Profile(faults=20, gap_s=1.0, settle_s=20.0, convergence_bound_s=60.0),
    "soak": Profile(faults=200, gap_s=2.0, settle_s=30.0, convergence_bound_s=90.0),
}


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Probe:
    """Short-deadline calls to the replicas (a paused replica must not stall the run)."""

    def __init__(self, cluster: NetCluster) -> None:
        self.c = cluster
        self.channels = {n: cluster.channel(a) for n, a in cluster.replica_addrs.items()}

    def call(self, replica: str, svc: str, method: str, req: object, timeout: float = 2.0) -> Any:
        ch = self.channels[replica]
        stub: Any = (
            cluster_pb2_grpc.ClusterServiceStub(ch)
            if svc == "cluster"
            else workload_pb2_grpc.WorkloadServiceStub(ch)
        )
        return getattr(stub, method)(req, timeout=timeout)

    def any(self, svc: str, method: str, req: object, timeout: float = 2.0) -> Any:
        last: Exception | None = None
        for name in self.channels:
            try:
                return self.call(name, svc, method, req, timeout)
            except grpc.RpcError as e:
                last = e
        raise RuntimeError(f"no replica answered {method}: {last}")

    def leader(self) -> str:
        try:
            return str(self.any("cluster", "ClusterStatus", cluster_pb2.ClusterStatusRequest()).leader)
        except RuntimeError:
            return ""

    def workloads(self, replica: str | None = None) -> list[workload_pb2.WorkloadSummary]:
        req = workload_pb2.ListWorkloadsRequest()
        resp = (
            self.call(replica, "workload", "ListWorkloads", req, 3.0)
            if replica
            else self.any("workload", "ListWorkloads", req, 3.0)
        )
        return list(resp.workloads)

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()


def gateway_routes(addr: str) -> frozenset[str] | None:
    try:
        with urllib.request.urlopen(f"http://{addr}/kunlun/status", timeout=2) as r:
            st = json.loads(r.read())
    except (OSError, ValueError):
        return None
    return frozenset(
        f"{w}={i['address']}" for w, v in st.get("workloads", {}).items() for i in v.get("instances", [])
    )


def observe(probe: Probe, t0: float) -> Observation:
    views: dict[str, str] = {}
    summaries: list[workload_pb2.WorkloadSummary] = []
    for name in probe.channels:
        try:
            ws = probe.workloads(name)
            devs = probe.call(name, "cluster", "ListDevices", cluster_pb2.ListDevicesRequest(), 3.0).devices
        except grpc.RpcError:
            views[name] = ""
            continue
        summaries = summaries or ws
        text = json.dumps(
            [
                sorted((w.workload.spec.name, w.workload.spec.replicas, w.workload.deleting) for w in ws),
                sorted((d.name, d.status) for d in devs),
            ]
        )
        views[name] = hashlib.sha256(text.encode()).hexdigest()[:16]
    pending: list[str] = []
    running: set[str] = set()
    for w in summaries:
        name = w.workload.spec.name
        live = [i for i in w.instances if i.phase == InstancePhase.RUNNING and i.endpoint]
        running |= {f"{name}={i.endpoint}" for i in live}
        for i in w.instances:
            if w.workload.deleting:
                pending.append(f"{name}/{i.ordinal} {i.phase} (workload deleted)")
            elif i.node and i.phase not in (InstancePhase.RUNNING, InstancePhase.STOPPED):
                pending.append(f"{name}/{i.ordinal} {i.phase} on {i.node}")
    routes = {g: gateway_routes(a) for g, a in probe.c.gateway_addrs.items()}
    return Observation(
        time.time() - t0, views, len(pending), frozenset(running), routes, ", ".join(pending[:5])
    )


def sampler(probe: Probe, h: RunHistory, t0: float, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        leader = probe.leader()
        try:
            ws = probe.workloads()
        except (RuntimeError, grpc.RpcError):
            ws = []
        insts = [i for w in ws for i in w.instances]
        running = sum(1 for i in insts if i.phase == InstancePhase.RUNNING)
        h.samples.append(Sample(time.time() - t0, leader, running, len(insts)))


def context_for(v: Verdict, eh: EtcdHistory, h: RunHistory) -> list[str]:
    """Events around the first violation: neighbouring revisions, or faults in effect."""
    first = v.violations[0] if v.violations else ""
    m = re.search(r"rev (\d+)", first)
    out: list[str] = []
    if m:
        rev = int(m.group(1))
        out += [
            f"rev {e.revision}: {e.kind} {e.device} -> {e.instance}"
            for e in eh.allocs
            if abs(e.revision - rev) <= 5
        ]
        out += [
            f"rev {w.revision}: leader write epoch {w.epoch}"
            for w in eh.leader_writes
            if abs(w.revision - rev) <= 5
        ]
        out += [f"rev {r}: leader {n}" for r, n in eh.leaders if abs(r - rev) <= 50]
    t = re.search(r"(\d+\.\d+)s", first)
    if t:
        at = float(t.group(1))
        name = first.split(":", 1)[0]
        out += [
            f"client {o.client} {o.kind}({'' if o.arg is None else o.arg}) {name} [{o.start:.3f}s .. {o.end:.3f}s]"
            f" {o.result} {o.code} {'' if o.read is None else repr(o.read)}"
            for o in sorted(h.api, key=lambda o: o.start)
            if o.name == name and at - 5 <= o.start <= at + 5
        ]
        out += [
            f"fault {f.kind} {f.target} [{f.start:.1f}s..{f.end:.1f}s]"
            for f in h.faults
            if f.start - 10 <= at <= f.end + 10
        ]
    return out


def drive(base: Path, run_id: str, profile_name: str, seed: int, out: Path, faults: int = 0) -> int:
    prof = PROFILES[profile_name]
    if faults > 0:
        prof = dataclasses.replace(prof, faults=faults)
    rng = random.Random(seed)
    cluster = net_cluster(base, run_id, etcd_tmpfs_mb=160)
    h = RunHistory()
    t_begin = time.monotonic()
    clients: subprocess.Popen[bytes] | None = None
    stop_file = base / "clients.stop"
    sample_stop = threading.Event()
    probe: Probe | None = None
    try:
        log(f"starting the cluster on {len(cluster.net.hosts)} hosts ({cluster.net.settings.subnet}.0/24)")
        cluster.start()
        probe = Probe(cluster)
        spec = workload_pb2.WorkloadSpec(name=SERVE_WORKLOAD, model=SERVE_WORKLOAD, replicas=2)
        probe.any("workload", "SubmitWorkload", workload_pb2.SubmitWorkloadRequest(spec=spec), 5.0)
        p = probe

        def serving() -> bool:
            w = p.any("workload", "GetWorkload", workload_pb2.GetWorkloadRequest(name=SERVE_WORKLOAD))
            eps = frozenset(
                f"{SERVE_WORKLOAD}={i.endpoint}"
                for i in w.instances
                if i.phase == InstancePhase.RUNNING and i.endpoint
            )
            return len(eps) == 2 and all(gateway_routes(a) == eps for a in cluster.gateway_addrs.values())

        wait_for(serving, 120, f"{SERVE_WORKLOAD} Running twice and routed by every gateway", interval=1.0)
        t0 = time.time()
        log(f"cluster up in {time.monotonic() - t_begin:.0f}s; load starts")
        clients = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "chaos.clients",
                f"--endpoints={','.join(cluster.replica_addrs.values())}",
                f"--gateways={','.join(cluster.gateway_addrs.values())}",
                f"--cert-dir={cluster.cert_dir}",
                f"--t0={t0}",
                f"--out={base / 'load'}",
                f"--stop-file={stop_file}",
                f"--seed={seed}",
                f"--max-duration={prof.faults * 40 + 120}",
            ],
            stdout=(base / "clients.log").open("ab"),
            stderr=subprocess.STDOUT,
        )
        threading.Thread(target=sampler, args=(probe, h, t0, sample_stop), daemon=True).start()
        injector = Injector(cluster, rng)
        time.sleep(3.0)  # a quiet baseline before the first fault
        for n, kind in enumerate(schedule(rng, prof.faults), 1):
            start = time.time() - t0
            try:
                inj = injector.inject(kind)
            except Exception as e:
                log(f"fault {n}: {kind} could not be injected: {e}")
                h.faults.append(FaultRecord(kind, "-", start, time.time() - t0, f"not injected: {e}"))
                continue
            log(f"fault {n}/{prof.faults}: {kind} on {inj.target}: {inj.detail}")
            time.sleep(KINDS[kind][0] * (1.0 + 0.25 * rng.random()))  # never shorter: pauses outlast TTLs
            try:
                inj.heal()
            except Exception as e:
                log(f"  heal of {kind} failed: {e}")
            end = time.time() - t0
            h.faults.append(FaultRecord(kind, inj.target, start, end, inj.detail))
            h.last_heal = end
            try:
                wait_for(lambda: probe is not None and probe.leader() != "", prof.settle_s, "a leader", 0.5)
            except TimeoutError:
                log(f"  no leader {prof.settle_s:.0f}s after healing {kind}")
            time.sleep(prof.gap_s)
        time.sleep(3.0)
        stop_file.touch()
        clients.wait(timeout=60)
        log("faults done; waiting for convergence")
        observations: list[Observation] = []
        deadline = time.monotonic() + prof.convergence_bound_s + 5
        while time.monotonic() < deadline:
            o = observe(probe, t0)
            observations.append(o)
            if not not_converged(o):
                break
            time.sleep(1.0)
        sample_stop.set()
        final = {
            w.workload.spec.name: ("deleting" if w.workload.deleting else f"r={w.workload.spec.replicas}")
            for w in probe.workloads()
        }
        certs = etcd_client_paths(cluster.cert_dir)
        eh = asyncio.run(read_history(list(cluster.etcd.endpoints), certs))
        for row in read_jsonl([base / "load" / "api.jsonl", base / "load" / "serve.jsonl"]):
            h.add(row)
        ledgers = cluster.ledger_files()
        entries = read_jsonl(ledgers)
        verdicts = [
            check_allocations(eh.allocs),
            check_engines(entries, len(ledgers)),
            check_lost_writes(h.api, final),
            check_linearizable(h.api),
            check_fencing(eh.leader_writes),
            check_convergence(observations, h.last_heal, prof.convergence_bound_s),
            check_serving(h.serve, h.faults),
        ]
        if not eh.complete:
            for v in verdicts[:1] + verdicts[4:5]:
                v.ok = False
                v.violations.insert(0, "etcd history was compacted during the run: incomplete")
        first = next((v for v in verdicts if not v.ok), None)
        out.mkdir(parents=True, exist_ok=True)
        h.write(out / "history.jsonl")
        meta = {
            "profile": profile_name,
            "seed": seed,
            "run_id": run_id,
            "duration_s": time.monotonic() - t_begin,
            "etcd_events": eh.events,
            "etcd_last_revision": eh.last_revision,
            "leader_elections": len(eh.leaders),
            "ledger_files": [str(p) for p in ledgers],
            "first_violation_context": context_for(first, eh, h) if first else [],
        }
        s = report.write(out, h, verdicts, meta)
        for v in verdicts:
            log(f"checker {v.name}: {'ok' if v.ok else 'FAIL'} — {v.summary}")
        if first:
            log(
                f"FIRST VIOLATION ({first.name}): {first.violations[0] if first.violations else first.summary}"
            )
            for line in s["first_violation_context"]:
                log(f"  around it: {line}")
        log(f"report: {out / 'report.md'}")
        return 0 if s["ok"] else 1
    finally:
        sample_stop.set()
        stop_file.touch()
        if clients is not None and clients.poll() is None:
            clients.kill()
            clients.wait(10)
        if probe is not None:
            probe.close()
        cluster.stop()
