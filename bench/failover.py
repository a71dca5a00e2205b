"""Leader failover time after kill -9 and after a graceful stop (SIGTERM), over N trials.

Measured from the signal to the moment a new leader key appears in etcd (seen by a watch).
Prints p50/p99 and the election TTL used. Usage: python bench/failover.py [--trials 20] [--ttl 5]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time

from bench.common import pct, temp_cluster
from controlplane import keys
from controlplane.store import EtcdStore, StoreSettings, WatchEvent
from devcluster.cluster import LocalCluster
from devcluster.procs import wait_for
from kunlun_common.pki import etcd_client_paths


async def one_trial(cluster: LocalCluster, store: EtcdStore, graceful: bool) -> float:
    kv = await store.get(keys.LEADER)
    while kv is None:
        await asyncio.sleep(0.05)
        kv = await store.get(keys.LEADER)
    old = keys.decode(kv.value)["name"]
    rev = await store.revision()
    proc = cluster.replicas[old]
    t0 = time.monotonic()
    proc.signal(signal.SIGTERM if graceful else signal.SIGKILL)
    async for ev in store.watch_prefix(keys.LEADER, rev + 1):
        if isinstance(ev, WatchEvent) and ev.kind == "put" and keys.decode(ev.kv.value)["name"] != old:
            elapsed = time.monotonic() - t0
            break
    await asyncio.to_thread(proc.wait, 15)
    cluster.restart_replica(old)
    await asyncio.to_thread(wait_for, lambda: cluster.replica_serving(old), 60, f"{old} back")
    return elapsed


async def run(cluster: LocalCluster, trials: int) -> dict[str, list[float]]:
    p = etcd_client_paths(cluster.cert_dir)
    store = EtcdStore(StoreSettings(cluster.etcd.endpoints, str(p.ca), str(p.cert), str(p.key)))
    out: dict[str, list[float]] = {"kill -9": [], "graceful": []}
    try:
        for i in range(trials):
            for mode in out:
                out[mode].append(await one_trial(cluster, store, graceful=(mode == "graceful")))
            print(
                f"  trial {i + 1}/{trials}: kill -9 {out['kill -9'][-1]:.2f}s, graceful {out['graceful'][-1]:.2f}s",
                flush=True,
            )
    finally:
        await store.close()
    return out


def measure(
    trials: int, ttl: int, renew_deadline: float = 3.0, retry_period: float = 1.0
) -> dict[str, list[float]]:
    """Failover times per mode, on a temporary cluster (also used by bench.check)."""
    with temp_cluster(
        election_ttl_s=ttl, renew_deadline_s=renew_deadline, retry_period_s=retry_period
    ) as cluster:
        print(
            f"leader failover, {trials} trials, ttl={ttl}s renew_deadline={renew_deadline}s retry_period={retry_period}s"
        )
        res = asyncio.run(run(cluster, trials))
    for mode, vals in res.items():
        print(
            f"{mode:>9}: p50 {pct(vals, 50):.2f}s  p99 {pct(vals, 99):.2f}s  max {max(vals):.2f}s  (n={len(vals)}, ttl {ttl}s)"
        )
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--ttl", type=int, default=5)
    ap.add_argument("--renew-deadline", type=float, default=3.0)
    ap.add_argument("--retry-period", type=float, default=1.0)
    a = ap.parse_args()
    measure(a.trials, a.ttl, a.renew_deadline, a.retry_period)


if __name__ == "__main__":
    main()
