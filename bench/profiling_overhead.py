"""CPU overhead of run-time profiling (`advanced_profiling`), on against off, in one run.

A representative replica-like workload runs in this process: an asyncio event loop with many
tasks that decode and encode protobuf records, render JSON and yield to the loop (as the API
handlers and watch consumers do), plus idle threads standing for gRPC's pollers. The same fixed
amount of work is done in alternating blocks with the real `Profiler` off and on (writing its trace
files to a temporary folder), and each block's process CPU time (every thread, the profiler's own
included) is measured. Alternating blocks cancel most of the drift of a shared machine; the median
of the per-pair ratios is printed, with the profiler thread's own CPU per second of profiling (its
cost in an idle process) and the trace bytes written.

    .venv/bin/python -m bench.profiling_overhead [--interval-ms 50] [--pairs 6] [--units 60000]

`--replica` measures a real replica instead: a local etcd and one replica (the leader), the same
number of API calls (ListWorkloads, GetSchedulerConfig) in each block, profiling switched through
the scheduler settings as an operator would, and the replica process's CPU time per block.

    .venv/bin/python -m bench.profiling_overhead --replica [--pairs 5] [--calls 400]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from kunlun_common.api import workload_pb2
from kunlun_common.profiling import Profiler, ProfilingMode
from kunlun_common.trace_ring import ProfileOutput


def _record() -> bytes:
    inst = workload_pb2.Instance(
        id="wl-0123456789-0",
        workload_id="wl-0123456789",
        node="node-a",
        phase="Running",
        target_devices=[f"node-a/ascend:{i}" for i in range(4)],
        endpoint="10.0.0.1:30000",
        launch_command=["python3", "-m", "sglang.launch_server", "--model-path", "/models/x", "--tp", "4"],
    )
    return inst.SerializeToString()


RECORD = _record()


def _handle(i: int) -> int:
    inst = workload_pb2.Instance()
    inst.ParseFromString(RECORD)
    inst.restarts = i
    doc = {"id": inst.id, "node": inst.node, "devices": list(inst.target_devices), "n": i}
    text = json.dumps(doc, sort_keys=True)
    return len(inst.SerializeToString()) + len(json.loads(text)["devices"])


async def _worker(units: int) -> int:
    total = 0
    for i in range(units):
        total += _handle(i)
        if i % 4 == 0:
            await asyncio.sleep(0)
    return total


async def _block(units: int, tasks: int) -> None:
    await asyncio.gather(*(_worker(units // tasks) for _ in range(tasks)))


def _replica_blocks(interval_ms: int, pairs: int, calls: int) -> None:
    from bench.common import cpu_seconds, temp_cluster
    from controlplane.scheduler.config import SchedulerConfig, to_yaml
    from kunlun_common.api import workload_pb2_grpc

    with temp_cluster(replicas=1) as cluster:
        name, addr = next(iter(cluster.replica_addrs.items()))
        pid = cluster.replicas[name].pid
        folder = cluster.profile_dir
        with cluster.channel(addr) as ch:
            stub = workload_pb2_grpc.WorkloadServiceStub(ch)

            state = {"on": False}

            def switch(on: bool) -> None:
                if state["on"] == on:
                    return
                state["on"] = on
                cfg = SchedulerConfig(advanced_profiling=on, profiling_interval_ms=interval_ms)
                stub.SetSchedulerConfig(workload_pb2.SchedulerConfigText(yaml=to_yaml(cfg)), timeout=10)
                end = time.monotonic() + 30
                while time.monotonic() < end:
                    files = sorted(folder.glob(f"replica.{name}-*.trace.json"))
                    last = files[-1].read_bytes() if files else b""
                    stopped = b'"profiling stopped"' in last
                    if (on and b'"profiling started"' in last and not stopped) or (not on and stopped):
                        return
                    time.sleep(0.05)
                raise SystemExit(f"the replica did not switch profiling {'on' if on else 'off'} within 30 s")

            def block() -> float:
                c0 = cpu_seconds(pid)
                for i in range(calls):
                    if i % 2:
                        stub.ListWorkloads(workload_pb2.ListWorkloadsRequest(), timeout=10)
                    else:
                        stub.GetSchedulerConfig(workload_pb2.SchedulerConfigRequest(), timeout=10)
                return cpu_seconds(pid) - c0

            block()  # warm up
            offs: list[float] = []
            ons: list[float] = []
            ratios: list[float] = []
            for pair in range(pairs):
                got: dict[bool, float] = {}
                for on in (pair % 2 == 1, pair % 2 == 0):
                    switch(on)
                    got[on] = block()
                    (ons if on else offs).append(got[on])
                ratios.append(got[True] / max(got[False], 1e-9))
            switch(False)
    med = statistics.median(ratios)
    print(
        f"profiling overhead on a replica: interval {interval_ms} ms, {pairs} off/on pairs of {calls} API calls"
    )
    print(
        f"  replica CPU per block off: median {statistics.median(offs):.2f} s   on: median {statistics.median(ons):.2f} s"
    )
    print(f"  on/off CPU ratio per pair: {', '.join(f'{r:.3f}' for r in ratios)}")
    print(
        f"  median ratio {med:.4f}  ->  overhead {100 * (med - 1):+.2f} %  (goal < 2 %; CPU read in clock ticks)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.profiling_overhead")
    ap.add_argument("--interval-ms", type=int, default=50, help="profiling interval (default 50)")
    ap.add_argument("--pairs", type=int, default=6, help="off/on block pairs (default 6)")
    ap.add_argument("--units", type=int, default=60000, help="work units per block (default 60000)")
    ap.add_argument("--tasks", type=int, default=50, help="concurrent tasks in the loop (default 50)")
    ap.add_argument("--threads", type=int, default=4, help="idle threads, like gRPC's pollers (default 4)")
    ap.add_argument("--replica", action="store_true", help="measure a real replica under API calls instead")
    ap.add_argument("--calls", type=int, default=400, help="API calls per block with --replica (default 400)")
    a = ap.parse_args()
    if a.replica:
        _replica_blocks(a.interval_ms, a.pairs, a.calls)
        return

    folder = Path(tempfile.mkdtemp(prefix="kunlun-prof-bench-"))
    stop = threading.Event()
    idle = [threading.Thread(target=stop.wait, name=f"idle-{i}", daemon=True) for i in range(a.threads)]
    for t in idle:
        t.start()
    prof = Profiler(ProfileOutput(dir=str(folder)), "bench.profiling")
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(_block(a.units // 4, a.tasks))  # warm up (imports, caches)
        offs: list[float] = []
        ons: list[float] = []
        ratios: list[float] = []
        profiled_wall = 0.0
        for pair in range(a.pairs):
            pair_cpu: dict[bool, float] = {}
            for on in (pair % 2 == 1, pair % 2 == 0):  # alternate which goes first
                prof.apply(ProfilingMode(on, a.interval_ms))
                c0, w0 = time.process_time(), time.monotonic()
                loop.run_until_complete(_block(a.units, a.tasks))
                cpu, wall = time.process_time() - c0, time.monotonic() - w0
                pair_cpu[on] = cpu
                if on:
                    profiled_wall += wall
                (ons if on else offs).append(cpu)
            prof.apply(ProfilingMode(False, a.interval_ms))
            ratios.append(pair_cpu[True] / pair_cpu[False])
        samples = prof.samples
        profiler_cpu = prof.cpu_s
        written = sum(p.stat().st_size for p in folder.glob("*.trace.json"))
    finally:
        prof.close()
        stop.set()
        loop.close()
        shutil.rmtree(folder, ignore_errors=True)

    med = statistics.median(ratios)
    print(
        f"profiling overhead: interval {a.interval_ms} ms, {a.pairs} off/on pairs of {a.units} work units, "
        f"{a.tasks} tasks + {a.threads} idle threads"
    )
    print(
        f"  CPU per block off: median {statistics.median(offs):.3f} s   on: median {statistics.median(ons):.3f} s"
    )
    print(f"  on/off CPU ratio per pair: {', '.join(f'{r:.3f}' for r in ratios)}")
    print(f"  median ratio {med:.4f}  ->  overhead {100 * (med - 1):+.2f} %  (goal < 2 %)")
    if profiled_wall > 0:
        per_sample = profiler_cpu / max(samples, 1)
        print(
            f"  profiler thread (thread CPU clock): {1e6 * per_sample:.0f} us per sample (stack walk of "
            f"{a.threads + 1} threads + its share of writing), = {100 * per_sample / (a.interval_ms / 1000):.2f} % "
            f"of one core at {a.interval_ms} ms; {samples} samples, {written / 1e6:.2f} MB of traces "
            f"({written / profiled_wall / 1e3:.1f} kB/s)"
        )


if __name__ == "__main__":
    main()
