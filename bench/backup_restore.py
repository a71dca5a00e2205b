"""Backup and restore speed: N keys in a 3-member TLS etcd, backed up and restored into a fresh one.

Every key is created by its own write, shaped like a cluster's keys (one workload key in 12): the
restore keeps the workloads' creation order exactly (one transaction per workload) and fills
transactions of up to 128 keys with the rest. Prints the time to read
and write the backup, to validate it, and to restore it, with keys/s and the file size.
Usage: python -m bench.backup_restore [--keys 5000] [--value-bytes 1500] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from controlplane import keys
from controlplane.store import EtcdStore, StoreSettings
from controlplane.store.admin import enable_etcd_auth
from controlplane.store.backup import AdminTarget, RestorePolicy, restore_backup, take_backup
from controlplane.store.backup_file import read_backup, write_backup
from devcluster.etcd_cluster import EtcdCluster, build_etcd_cluster
from devcluster.procs import wait_for
from kunlun_common.pki import ClusterCerts, etcd_client_paths, init_cluster_certs

POLICY = RestorePolicy(
    prefix="/kunlun/",
    never=keys.NEVER_RESTORED,
    live=keys.LIVE_MARKERS,
    ordered=(keys.WORKLOADS,),
    marker=keys.RESTORING,
)


def _store(cert_dir: Path, eps: tuple[str, ...]) -> EtcdStore:
    p = etcd_client_paths(cert_dir)
    return EtcdStore(StoreSettings(eps, str(p.ca), str(p.cert), str(p.key), request_timeout_s=5.0))


def _ready(cert_dir: Path, eps: tuple[str, ...]) -> bool:
    async def check() -> bool:
        s = _store(cert_dir, eps)
        try:
            await s.revision()
            return True
        finally:
            await s.close()

    return asyncio.run(check())


def _etcd(base: Path, cert_dir: Path, token: str) -> EtcdCluster:
    c = build_etcd_cluster(base, cert_dir, token=token)
    c.start()
    wait_for(lambda: _ready(cert_dir, c.endpoints), 60, "etcd")
    enable_etcd_auth(c.endpoints, cert_dir)
    return c


def _cluster_keys(n: int) -> list[str]:
    """Keys shaped like a cluster's: per workload its name, 2 instances with their status, slot and
    allocation, and 3 audit records (one workload key in 12)."""
    out: list[str] = []
    i = 0
    while len(out) < n:
        w = f"w-{i:06d}"
        out += [keys.workload(w), keys.workload_name(f"name-{i}")]
        for o in range(2):
            out += [
                keys.instance(f"{w}-{o}-1"),
                keys.instance_status(f"{w}-{o}-1"),
                keys.instance_slot(w, o),
                keys.alloc(f"node-{i}/ascend:{o}"),
            ]
        out += [f"{keys.AUDIT}{i:08d}-{a}" for a in range(2)]
        i += 1
    return out[:n]


async def _fill(cert_dir: Path, eps: tuple[str, ...], n: int, size: int) -> None:
    """Every key by its own write, in order (as the control plane creates them, one by one)."""
    s = _store(cert_dir, eps)
    value = json.dumps({"schema": 1, "pad": "x" * size}).encode()
    names = _cluster_keys(n)
    sem = asyncio.Semaphore(32)

    async def one(key: str) -> None:
        async with sem:
            await s.put(key, value)

    try:
        await asyncio.gather(*(one(k) for k in names))
    finally:
        await s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=5000)
    ap.add_argument("--value-bytes", type=int, default=1500)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    base = Path(
        tempfile.mkdtemp(prefix="kunlun-bench-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    )
    cert_dir = base / "certs"
    init_cluster_certs(cert_dir, ClusterCerts())
    clusters: list[EtcdCluster] = []
    try:
        src = _etcd(base / "etcd-a", cert_dir, "bench-a")
        clusters.append(src)
        asyncio.run(_fill(cert_dir, src.endpoints, args.keys, args.value_bytes))
        path = base / "bench.backup"
        t0 = time.perf_counter()
        header, records = asyncio.run(take_backup(AdminTarget(src.endpoints, cert_dir), POLICY))
        write_backup(path, header, records)
        t_backup = time.perf_counter() - t0
        t0 = time.perf_counter()
        header, records = read_backup(path)
        t_validate = time.perf_counter() - t0
        dst = _etcd(base / "etcd-b", cert_dir, "bench-b")
        clusters.append(dst)
        t0 = time.perf_counter()
        result = asyncio.run(restore_backup(AdminTarget(dst.endpoints, cert_dir), header, records, POLICY))
        t_restore = time.perf_counter() - t0
        out = {
            "keys": header.keys,
            "file_bytes": path.stat().st_size,
            "backup_s": round(t_backup, 2),
            "validate_s": round(t_validate, 2),
            "restore_s": round(t_restore, 2),
            "restore_keys_per_s": round(result.written / t_restore),
            "backup_keys_per_s": round(header.keys / t_backup),
        }
    finally:
        for c in clusters:
            c.stop()
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        print(json.dumps(out))
    else:
        print(
            f"{out['keys']} keys, {out['file_bytes'] / 1e6:.1f} MB file: backup {out['backup_s']} s "
            f"({out['backup_keys_per_s']} keys/s), validate {out['validate_s']} s, restore {out['restore_s']} s "
            f"({out['restore_keys_per_s']} keys/s)"
        )


if __name__ == "__main__":
    main()
