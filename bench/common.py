"""Shared helpers of the benchmarks: percentiles and a cluster in a temp dir."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from devcluster.cluster import ClusterSpec, LocalCluster


def pct(values: Sequence[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(p / 100 * len(s)) - 1))
    return s[k]


@contextmanager
def temp_cluster(**kw: object) -> Iterator[LocalCluster]:
    base = Path(
        tempfile.mkdtemp(prefix="kunlun-bench-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    )
    cluster = LocalCluster(ClusterSpec(base_dir=base, **kw))  # type: ignore[arg-type]
    try:
        cluster.base.mkdir(parents=True, exist_ok=True)
        cluster.make_certs()
        cluster.start_etcd()
        cluster.start_replicas()
        yield cluster
    finally:
        cluster.stop()
        if os.environ.get("KUNLUN_BENCH_KEEP"):
            print(f"cluster files kept in {base} (KUNLUN_BENCH_KEEP)", flush=True)
        else:
            shutil.rmtree(base, ignore_errors=True)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    """Resident memory of a process (VmRSS from /proc), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")
