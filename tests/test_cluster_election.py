"""Leader election and fencing across three real replica processes."""

from __future__ import annotations

import asyncio
import re

from controlplane import keys
from controlplane.store import EtcdStore, WatchEvent
from devcluster.cluster import LocalCluster
from devcluster.procs import wait_for
from kunlun_common.api import cluster_pb2
from tests.conftest import store_settings


def status(cluster: LocalCluster) -> cluster_pb2.ClusterStatusResponse:
    resp = cluster.call_any("ClusterStatus", cluster_pb2.ClusterStatusRequest())
    assert isinstance(resp, cluster_pb2.ClusterStatusResponse)
    return resp


def leader_of(cluster: LocalCluster, exclude: str = "") -> str:
    name = status(cluster).leader
    return name if name and name != exclude else ""


def test_exactly_one_leader(cluster: LocalCluster) -> None:
    wait_for(lambda: leader_of(cluster), 30, "a leader")
    st = status(cluster)
    flagged = [r.name for r in st.replicas if r.leader]
    assert flagged == [st.leader]
    assert len(st.replicas) == 3
    assert {r.name for r in st.replicas} == set(cluster.replicas)
    assert all(r.pid == cluster.replicas[r.name].pid for r in st.replicas)
    assert len(st.etcd_members) == 3 and all(m.healthy for m in st.etcd_members)
    assert sum(m.leader for m in st.etcd_members) == 1


def test_kill_leader_elects_another_and_graph_survives(cluster: LocalCluster) -> None:
    wait_for(lambda: leader_of(cluster), 30, "a leader")
    old = leader_of(cluster)
    before = {d.name for d in cluster.devices()}
    cluster.replicas[old].kill()
    wait_for(lambda: leader_of(cluster, exclude=old), 30, "a new leader after kill -9")
    assert leader_of(cluster) in set(cluster.replicas) - {old}
    assert {d.name for d in cluster.devices()} == before
    cluster.restart_replica(old)
    wait_for(lambda: cluster.replica_serving(old), 30, f"{old} to serve again")


def test_graceful_stop_resigns_at_once(cluster: LocalCluster) -> None:
    wait_for(lambda: leader_of(cluster), 30, "a leader")
    old = leader_of(cluster)
    proc = cluster.replicas[old]
    proc.stop()
    assert "resigned leadership" in proc.log_text()
    wait_for(lambda: leader_of(cluster, exclude=old), 30, "a new leader after graceful stop")
    cluster.restart_replica(old)
    wait_for(lambda: cluster.replica_serving(old), 30, f"{old} to serve again")


def _epochs_written(cluster: LocalCluster, since: int) -> list[tuple[int, int]]:
    """(revision, epoch) of every leader-state write from revision `since` until now."""

    async def read() -> list[tuple[int, int]]:
        store = EtcdStore(store_settings(cluster.cert_dir, cluster.etcd.endpoints))
        try:
            end = await store.revision()
            out: list[tuple[int, int]] = []
            async with asyncio.timeout(30):
                async for ev in store.watch_prefix(keys.LEADER_STATE, since):
                    if isinstance(ev, WatchEvent):
                        out.append((ev.kv.mod_revision, int(keys.decode(ev.kv.value)["epoch"])))
                        if ev.kv.mod_revision >= end:
                            break
            return out
        finally:
            await store.close()

    return asyncio.run(read())


def test_paused_leader_cannot_commit_after_waking(cluster: LocalCluster) -> None:
    wait_for(lambda: leader_of(cluster), 30, "a leader")
    old = leader_of(cluster)
    old_epoch = status(cluster).leader_epoch
    proc = cluster.replicas[old]
    log_before = len(proc.log_text())
    proc.pause()
    try:
        wait_for(
            lambda: leader_of(cluster, exclude=old), 30, "another replica to take over from the paused leader"
        )
        new_epoch = status(cluster).leader_epoch
        assert new_epoch > old_epoch
        # the new leader commits (its leader-state writes carry its epoch)
        wait_for(
            lambda: any(e == new_epoch for _, e in _epochs_written(cluster, new_epoch)),
            30,
            "a commit by the new leader",
        )
    finally:
        proc.resume()
    # the old leader wakes up, tries to act as leader, is refused by etcd and steps down
    wait_for(lambda: "stepped down" in proc.log_text()[log_before:], 30, "the old leader to step down")
    woke = proc.log_text()[log_before:]
    assert re.search(r"fenced write refused|TTL 0|renew deadline", woke), woke[-2000:]
    history = _epochs_written(cluster, new_epoch)
    assert history, "no leader-state writes since the new epoch"
    assert all(epoch != old_epoch for _, epoch in history), f"the deposed leader committed: {history}"
    assert leader_of(cluster) != old
    assert proc.alive()
