"""`kunlun-cli model verify` throughput against `sha256sum` of the same bytes, and peak memory of pack.

Builds a model folder with one safetensors shard of --size-mb of incompressible bytes (not sparse),
packs it with `kunlun-cli model pack` (peak RSS of that process), then reads the package alternately
with `sha256sum PKG` and `kunlun-cli model verify --package PKG`, --rounds times each, all from the
page cache after a warm-up read, and prints the best and median of each and their ratio
(verify / sha256sum throughput; the goal is at least 0.9). Process start-up is included in both.
Usage: python -m bench.model_verify [--size-mb 1024] [--rounds 3] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLI = [sys.executable, "-m", "controlplane.cli.main"]


def make_model(folder: Path, size: int) -> None:
    folder.mkdir(parents=True)
    block = os.urandom(4 << 20)
    n = size - 8
    header = b""
    for _ in range(3):
        header = json.dumps({"w": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
        header += b" " * (-len(header) % 8)
        n = size - 8 - len(header)
    with (folder / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        left = n
        while left:
            k = min(left, len(block))
            f.write(block[:k])
            left -= k
    (folder / "config.json").write_text(json.dumps({"architectures": ["BenchForCausalLM"]}))
    (folder / "tokenizer.json").write_text("{}")


def timed(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS MiB) of one process; it must succeed."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert p.stderr is not None
    err = p.stderr.read()
    _, status, usage = os.wait4(p.pid, 0)
    secs = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {err.decode()[-500:]}")
    return secs, usage.ru_maxrss // 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--size-mb", type=int, default=1024, help="weights size in MB (1e6 bytes); 2000 for the 2 GB figure"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to build (default: the system temp dir)")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="kunlun-bench-pkg-", dir=args.dir))
    try:
        size = args.size_mb * 1_000_000
        make_model(base / "bench-model", size)
        pkg = base / "bench.kunlunpkg"
        pack_s, pack_rss = timed(
            [*CLI, "model", "pack", "--model", str(base / "bench-model"), "--out", str(pkg), "--quiet"]
        )
        nbytes = pkg.stat().st_size
        verify = [*CLI, "model", "verify", "--package", str(pkg), "--allow-unsigned", "--quiet"]
        sha = ["sha256sum", str(pkg)]
        timed(sha)  # warm the page cache
        s_times, v_times, v_rss = [], [], 0
        for _ in range(args.rounds):
            s_times.append(timed(sha)[0])
            secs, rss = timed(verify)
            v_times.append(secs)
            v_rss = max(v_rss, rss)
        mb = nbytes / 1e6
        print(f"package: {nbytes} bytes ({mb:.0f} MB), {args.rounds} rounds, alternating, page cache warm")
        print(
            f"pack:        {pack_s:6.2f} s  ({mb / pack_s:7.1f} MB/s incl. hashing pass)  peak RSS {pack_rss} MiB"
        )
        for label, ts in (("sha256sum", s_times), ("model verify", v_times)):
            print(
                f"{label + ':':<13}best {min(ts):6.2f} s ({mb / min(ts):7.1f} MB/s)  "
                f"median {statistics.median(ts):6.2f} s ({mb / statistics.median(ts):7.1f} MB/s)"
            )
        print(f"verify peak RSS {v_rss} MiB")
        print(
            f"verify/sha256sum throughput: best {min(s_times) / min(v_times):.2f}x, "
            f"median {statistics.median(s_times) / statistics.median(v_times):.2f}x (goal >= 0.9x)"
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
