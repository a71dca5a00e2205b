"""The pure scheduler of two source trees, timed in one run, alternating, on this interpreter.

Each tree (a checkout of this repository, e.g. a `git worktree` of a reference commit) is timed in
its own subprocess with `PYTHONPATH=<tree>`, so both run the same Python on the same machine in
turns; the graph and the queue are bench.scheduler_decisions' (1000 nodes x 8 devices, 5000 queued
single-device instances by default), built by each tree's own copy of that module.

Both trees' workers stay up for the whole run and take turns call by call (the order flips every
call), so a change in machine load hits both alike. Per tree and round it reports the best CPU time
(`time.process_time`) of `--calls` calls of:

- full: `schedule()` deciding the whole queue;
- commit: `schedule(max_placements=50)` (index build and ordering included);
- index: building the per-snapshot index (`PlanBuilder(graph, [], config)`);
- decide: `PlanBuilder.decide()` over the whole queue in weighted-fair order (the index build and
  the ordering untimed), i.e. full less index and ordering.

Each call starts after a `gc.collect()`, so whether a full collection lands inside a call depends on
that call's own allocations, not on what ran before it.

and a digest of the whole-queue plan (placements and unplaced reasons), equal when both trees
decide the same. Prints one row per tree per round, then the best of all rounds and the ratio of
each tree to the first one (of the best calls, and of the median calls).

Usage: python -m bench.scheduler_vs_ref REF_TREE NEW_TREE [--rounds 4] [--calls 5] [--nodes 1000]
       [--queue 5000]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

_WORKER = "--worker"
MEASURES = ("full", "commit", "index", "decide")


def _worker(nodes: int, queue: int, seed: int) -> None:
    """Runs inside a tree's subprocess: imports that tree's scheduler, then times one call per
    line read from stdin (a name of MEASURES) and answers its CPU ms on stdout."""
    import random

    from bench.scheduler_decisions import build_graph, build_queue
    from controlplane.scheduler import PlanBuilder, SchedulerConfig, order_pending, schedule

    rng = random.Random(seed)
    graph = build_graph(nodes, rng)
    pending = build_queue(queue, rng)
    config = SchedulerConfig()
    plan = schedule(graph, pending, [], config, now=0.0)
    digest = hashlib.sha256()
    for p in plan.placements:
        digest.update(repr((p.instance_id, p.node, p.devices, p.score, p.preempts)).encode())
    for u in plan.unplaced:
        digest.update(repr((u.instance_id, sorted(u.reasons.items()))).encode())
    print(
        json.dumps(
            {
                "placed": len(plan.placements),
                "unplaced": len(plan.unplaced),
                "digest": digest.hexdigest()[:12],
            }
        )
    )
    sys.stdout.flush()

    def timed(fn: Callable[[], object]) -> Callable[[], float]:
        def run() -> float:
            t0 = time.process_time()
            fn()
            return time.process_time() - t0

        return run

    def decide_all() -> float:
        builder = PlanBuilder(graph, [], config)
        ordered = order_pending(pending, config.priority_weights)
        t0 = time.process_time()
        for inst in ordered:
            builder.decide(inst)
        return time.process_time() - t0

    calls: dict[str, Callable[[], float]] = {
        "full": timed(lambda: schedule(graph, pending, [], config, now=0.0)),
        "commit": timed(lambda: schedule(graph, pending, [], config, now=0.0, max_placements=50)),
        "index": timed(lambda: PlanBuilder(graph, [], config)),
        "decide": decide_all,
    }
    for line in sys.stdin:
        fn = calls[line.strip()]
        gc.collect()  # every call starts from the same collector state (a full collection costs tens of ms)
        print(f"{fn() * 1000:.3f}")
        sys.stdout.flush()


class Tree:
    """A worker subprocess with `PYTHONPATH=<tree>`."""

    def __init__(self, path: Path, args: argparse.Namespace) -> None:
        self.path = path
        self.label = _label(path)
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            _WORKER,
            str(args.nodes),
            str(args.queue),
            str(args.seed),
        ]
        env = dict(os.environ, PYTHONPATH=str(path), PYTHONHASHSEED="0")
        self.proc = subprocess.Popen(
            cmd, env=env, cwd=path, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.plan: dict[str, object] = json.loads(self._read())

    def _read(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker for {self.path} exited with {self.proc.wait()}")
        return line

    def time(self, measure: str) -> float:
        """CPU ms of one call of `measure`."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(measure + "\n")
        self.proc.stdin.flush()
        return float(self._read())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def _label(tree: Path) -> str:
    head = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return f"{tree.name}@{head or '?'}{'+' if dirty else ''}"


def _row(head: str, label: str, width: int, values: dict[str, float]) -> str:
    return f"{head:>6}  {label:<{width}}" + "".join(f"  {values[m]:8.1f}" for m in MEASURES)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == _WORKER:
        nodes, queue, seed = (int(a) for a in sys.argv[2:5])
        _worker(nodes, queue, seed)
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trees", type=Path, nargs="+", help="source trees; the first is the reference")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=5, help="calls per tree, measure and round")
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--queue", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    trees = [Tree(t.resolve(), args) for t in args.trees]
    try:
        width = max(len(t.label) for t in trees)
        print(
            f"{args.nodes} nodes x 8 devices, {args.queue} queued; CPU ms, best of {args.calls} calls per "
            f"round, trees alternating call by call; {sys.implementation.name} {sys.version.split()[0]}; "
            f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
        )
        for t in trees:
            print(
                f"  {t.label}: {t.plan['placed']} placed, {t.plan['unplaced']} unplaced, plan {t.plan['digest']}"
            )
        header = f"{'round':>6}  {'tree':<{width}}" + "".join(
            f"  {m:>8}" for m in ("full", "commit50", "index", "decide")
        )
        print(header)
        samples: list[dict[str, list[float]]] = [{m: [] for m in MEASURES} for _ in trees]
        for rnd in range(1, args.rounds + 1):
            best: list[dict[str, float]] = [{} for _ in trees]
            for measure in MEASURES:
                for call in range(args.calls):
                    order = list(range(len(trees)))
                    if (rnd + call) % 2 == 0:
                        order.reverse()
                    for i in order:
                        ms = trees[i].time(measure)
                        samples[i][measure].append(ms)
                        best[i][measure] = min(best[i].get(measure, ms), ms)
            for i, t in enumerate(trees):
                print(_row(str(rnd), t.label, width, best[i]))
        print(header.replace("round", " best", 1) + f"  vs {trees[0].label} (best; median)")
        mins = [{m: min(s[m]) for m in MEASURES} for s in samples]
        meds = [{m: statistics.median(s[m]) for m in MEASURES} for s in samples]
        for i, t in enumerate(trees):
            ratio = "  ".join(
                f"{m} {mins[i][m] / mins[0][m]:.3f}; {meds[i][m] / meds[0][m]:.3f}" for m in MEASURES
            )
            print(_row("", t.label, width, mins[i]) + f"  {ratio}")
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        for t in trees:
            t.close()


if __name__ == "__main__":
    main()
