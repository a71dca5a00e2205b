"""Chaos run: kill -9, SIGSTOP/SIGCONT and gracefully stop leaders of a local cluster, repeatedly,
and check after every round: there is one leader, the device graph is complete, and no deposed
leader ever committed (the whole leader-state history, not only the final state).

Usage: python -m chaos.leader_faults [--rounds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import tempfile
from pathlib import Path

from chaos.invariants import LeaderWrite, deposed_leader_commits
from controlplane import keys
from controlplane.store import EtcdStore, StoreSettings, WatchEvent
from devcluster.cluster import ClusterSpec, LocalCluster
from devcluster.procs import wait_for
from kunlun_common.pki import etcd_client_paths


async def leader_history(cluster: LocalCluster, since: int) -> list[LeaderWrite]:
    p = etcd_client_paths(cluster.cert_dir)
    store = EtcdStore(StoreSettings(cluster.etcd.endpoints, str(p.ca), str(p.cert), str(p.key)))
    try:
        end = await store.revision()
        out: list[LeaderWrite] = []
        async with asyncio.timeout(60):
            async for ev in store.watch_prefix(keys.LEADER_STATE, since):
                if isinstance(ev, WatchEvent):
                    out.append(LeaderWrite(ev.kv.mod_revision, int(keys.decode(ev.kv.value)["epoch"])))
                    if ev.kv.mod_revision >= end:
                        break
        return out
    finally:
        await store.close()


def run(rounds: int, seed: int) -> int:
    rng = random.Random(seed)
    base = Path(tempfile.mkdtemp(prefix="kunlun-chaos-"))
    cluster = LocalCluster(ClusterSpec(base_dir=base))
    failures = 0
    try:
        cluster.start()
        expected = {d.name for d in cluster.devices()}
        for r in range(rounds):
            wait_for(cluster.leader, 60, "a leader")
            leader = cluster.leader()
            fault = rng.choice(["kill", "pause", "stop"])
            proc = cluster.replicas[leader]
            print(f"round {r + 1}/{rounds}: {fault} leader {leader} (pid {proc.pid})", flush=True)
            if fault == "kill":
                proc.kill()
            elif fault == "stop":
                proc.stop()
            else:
                proc.pause()
            wait_for(lambda old=leader: cluster.leader() not in ("", old), 60, "a new leader")
            if fault == "pause":
                proc.resume()
                wait_for(lambda p=proc: "stepped down" in p.log_text(), 60, "the paused leader to step down")
            else:
                cluster.restart_replica(leader)
                wait_for(lambda n=leader: cluster.replica_serving(n), 60, f"{leader} back")
            got = {d.name for d in cluster.devices()}
            if got != expected:
                failures += 1
                print(f"  VIOLATION: device graph incomplete: missing {sorted(expected - got)}")
        history = asyncio.run(leader_history(cluster, 1))
        bad = deposed_leader_commits(history)
        print(
            f"checked {len(history)} fenced leader writes over {rounds} rounds: {len(bad)} by deposed leaders"
        )
        failures += len(bad)
    finally:
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)
    print("OK" if failures == 0 else f"FAILED: {failures} violations")
    return 1 if failures else 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    raise SystemExit(run(a.rounds, a.seed))


if __name__ == "__main__":
    main()
