"""The seven checkers of a chaos run. Each reads recorded history (never only the final state) and
returns a Verdict; a Verdict that is not ok names the first violation and what surrounds it.

1. allocations: no device held by two instances at any etcd revision     (chaos.invariants)
2. engines: no two engines of one instance / on one device alive at once (the engine ledger)
3. lost writes: every acknowledged submit exists at the end unless a delete may have removed it
4. linearizable: the workload API against a register model               (chaos.linearizable)
5. fencing: no write by a deposed leader after its successor's epoch     (chaos.invariants)
6. convergence: all views agree within a bound after the last heal
7. serving: client-visible errors through the gateways per fault kind
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from chaos.history import OK, UNKNOWN, ApiOp, FaultRecord, ServeOp
from chaos.invariants import AllocEvent, LeaderWrite, deposed_leader_commits, double_allocations
from chaos.linearizable import check_all


@dataclass
class Verdict:
    """One checker's result."""

    name: str
    ok: bool
    summary: str
    """One line: what was checked and what was found."""
    violations: list[str] = field(default_factory=list)
    """Every violation found, first one first, with the revisions/events around it."""

    def json(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "summary": self.summary, "violations": self.violations}


# ----------------------------------------------------------------------------- 1. allocations
def check_allocations(events: Sequence[AllocEvent]) -> Verdict:
    bad = double_allocations(events)
    revs = {e.revision for e in events}
    return Verdict(
        "allocations",
        not bad,
        f"{len(events)} allocation changes over {len(revs)} revisions: {len(bad)} double allocations",
        bad,
    )


# ----------------------------------------------------------------------------- 2. engine ledger
@dataclass(frozen=True)
class EngineLife:
    """One engine process from its ledger start to its stop (open: still alive at the end)."""

    node: str
    instance: str
    devices: tuple[str, ...]
    pid: int
    boot_id: str
    start_mono: int
    start_wall: int
    stop_mono: float
    stop_wall: float

    def label(self) -> str:
        return f"{self.instance} pid {self.pid} on {self.node} [{','.join(self.devices)}]"


def engine_lives(entries: Sequence[Mapping[str, Any]]) -> tuple[list[EngineLife], list[str]]:
    """Pair start and stop events of the merged ledgers; also return malformed-entry problems."""
    problems: list[str] = []
    open_: dict[tuple[str, str, int, str], Mapping[str, Any]] = {}
    lives: list[EngineLife] = []
    last_boot_start: dict[tuple[str, str], int] = {}

    def life(s: Mapping[str, Any], stop_mono: float, stop_wall: float) -> EngineLife:
        return EngineLife(
            str(s["node"]),
            str(s["instance"]),
            tuple(str(d) for d in s.get("devices", [])),
            int(s["pid"]),
            str(s.get("boot_id", "")),
            int(s["mono_ns"]),
            int(s["wall_ms"]),
            stop_mono,
            stop_wall,
        )

    def order(e: Mapping[str, Any]) -> tuple[int, int]:
        return (int(e.get("wall_ms", 0)), int(e.get("mono_ns", 0)))

    valid = []
    for e in entries:
        missing = [k for k in ("event", "node", "instance", "pid", "wall_ms", "mono_ns") if k not in e]
        if missing or e.get("event") not in ("start", "stop"):
            problems.append(f"malformed ledger entry {dict(e)}: missing {missing or 'a valid event'}")
            continue
        valid.append(e)
        key = (str(e["node"]), str(e.get("boot_id", "")))
        last_boot_start[key] = min(last_boot_start.get(key, int(e["wall_ms"])), int(e["wall_ms"]))
    for e in sorted(valid, key=order):
        k = (str(e["node"]), str(e.get("boot_id", "")), int(e["pid"]), str(e["instance"]))
        if e["event"] == "start":
            open_[k] = e
        else:
            if k not in open_:  # a stop recorded with another pid: the instance's oldest open start
                k = next((o for o in open_ if o[0] == k[0] and o[1] == k[1] and o[3] == k[3]), k)
            if k in open_:
                s = open_.pop(k)
                lives.append(life(s, int(e["mono_ns"]), int(e["wall_ms"])))
    for (node, boot, _, _), s in open_.items():
        # an engine never stopped in an earlier boot ended when the node rebooted
        later = [w for (n, b), w in last_boot_start.items() if n == node and b != boot and w > s["wall_ms"]]
        lives.append(life(s, math.inf, float(min(later)) if later else math.inf))
    return lives, problems


def _overlap(a: EngineLife, b: EngineLife) -> bool:
    if a.node == b.node and a.boot_id == b.boot_id:
        return a.start_mono < b.stop_mono and b.start_mono < a.stop_mono
    return a.start_wall < b.stop_wall and b.start_wall < a.stop_wall


def check_engines(entries: Sequence[Mapping[str, Any]], ledger_files: int) -> Verdict:
    if ledger_files == 0:
        return Verdict(
            "engines", False, "no ledger: no engine ledger file was found, nothing could be checked"
        )
    lives, problems = engine_lives(entries)
    bad: list[str] = []
    by_instance: dict[str, list[EngineLife]] = defaultdict(list)
    by_device: dict[str, list[EngineLife]] = defaultdict(list)
    for lf in lives:
        by_instance[lf.instance].append(lf)
        for d in lf.devices:
            by_device[d].append(lf)
    for what, groups in (("instance", by_instance), ("device", by_device)):
        for key, group in sorted(groups.items()):
            group.sort(key=lambda x: x.start_wall)
            for i, a in enumerate(group):
                for b in group[i + 1 :]:
                    if _overlap(a, b):
                        bad.append(
                            f"{what} {key}: {a.label()} (start wall {a.start_wall} ms, stop {a.stop_wall})"
                            f" overlaps {b.label()} (start wall {b.start_wall} ms, stop {b.stop_wall})"
                        )
    return Verdict(
        "engines",
        not bad and not problems,
        f"{len(lives)} engine lifetimes from {ledger_files} ledger files: {len(bad)} overlaps,"
        f" {len(problems)} malformed entries",
        bad + problems,
    )


# ----------------------------------------------------------------------------- 3. lost writes
def check_lost_writes(ops: Sequence[ApiOp], final: Mapping[str, str]) -> Verdict:
    """`final`: the workloads that exist at the end (name -> "r=N" or "deleting")."""
    bad: list[str] = []
    acked = 0
    by_name: dict[str, list[ApiOp]] = defaultdict(list)
    for o in ops:
        by_name[o.name].append(o)
    for name, hist in sorted(by_name.items()):
        subs = [o for o in hist if o.kind == "submit" and o.result == OK]
        if not subs:
            continue
        acked += 1
        last = max(subs, key=lambda o: o.end)
        deletes = [o for o in hist if o.kind == "delete" and o.result in (OK, UNKNOWN) and o.end > last.start]
        if not deletes and name not in final:
            bad.append(
                f"{name}: submit by client {last.client} acknowledged at {last.end:.3f}s"
                f" (replicas {last.arg}) but the workload is gone at the end and no delete was sent"
            )
    return Verdict(
        "lost-writes",
        not bad,
        f"{acked} acknowledged workloads, {len(final)} at the end: {len(bad)} lost",
        bad,
    )


# ----------------------------------------------------------------------------- 4. linearizable
def check_linearizable(ops: Sequence[ApiOp], budget_per_name: int = 200_000) -> Verdict:
    results = check_all(ops, budget_per_name)
    bad = [f"{r.name}: {r.detail}" for r in results if r.ok is False]
    unsure = [f"{r.name}: inconclusive ({r.detail})" for r in results if r.ok is None]
    n_ops = sum(r.ops for r in results)
    return Verdict(
        "linearizable",
        not bad and not unsure,
        f"{len(results)} workload names, {n_ops} calls: {len(bad)} not linearizable, {len(unsure)} inconclusive",
        bad + unsure,
    )


# ----------------------------------------------------------------------------- 5. fencing
def check_fencing(writes: Sequence[LeaderWrite]) -> Verdict:
    bad = deposed_leader_commits(writes)
    epochs = sorted({w.epoch for w in writes})
    return Verdict(
        "fencing",
        not bad,
        f"{len(writes)} fenced leader writes over {len(epochs)} epochs: {len(bad)} by deposed leaders",
        [f"rev {w.revision}: write of epoch {w.epoch} after a newer epoch had committed" for w in bad],
    )


# ----------------------------------------------------------------------------- 6. convergence
@dataclass(frozen=True)
class Observation:
    """One look at the whole cluster after the last heal."""

    t: float
    replica_views: Mapping[str, str]
    """replica -> digest of its workload and device lists ("" when it did not answer)."""
    pending: int
    """Placed instances (they hold devices, so they should run) that are not Running, plus instances
    of deleted workloads that are still there. Instances no device fits are not counted."""
    running_endpoints: frozenset[str]
    """workload=address of every Running instance."""
    gateway_routes: Mapping[str, frozenset[str] | None]
    """gateway -> the workload=address pairs it routes to (None when it did not answer)."""
    pending_detail: str = ""
    """Which instances are pending and in which phase."""


def not_converged(o: Observation) -> str:
    """Why `o` is not converged ("" when it is)."""
    views = set(o.replica_views.values())
    if "" in views:
        return "replicas not answering: " + ",".join(r for r, v in o.replica_views.items() if not v)
    if len(views) > 1:
        return f"replicas disagree ({len(views)} different workload/device lists)"
    if o.pending:
        return f"{o.pending} instances should run but are not Running: {o.pending_detail}"
    for g, routes in sorted(o.gateway_routes.items()):
        if routes is None:
            return f"gateway {g} not answering"
        if routes != o.running_endpoints:
            extra, missing = routes - o.running_endpoints, o.running_endpoints - routes
            return f"gateway {g} routes differ: extra {sorted(extra)}, missing {sorted(missing)}"
    return ""


def check_convergence(observations: Sequence[Observation], last_heal: float, bound_s: float) -> Verdict:
    after = sorted((o for o in observations if o.t >= last_heal), key=lambda o: o.t)
    for o in after:
        if not not_converged(o):
            took = o.t - last_heal
            return Verdict(
                "convergence",
                took <= bound_s,
                f"converged {took:.1f}s after the last heal (bound {bound_s:.0f}s), "
                f"{len(o.running_endpoints)} running endpoints, {len(o.gateway_routes)} gateways agree",
                [] if took <= bound_s else [f"converged only after {took:.1f}s"],
            )
    why = not_converged(after[-1]) if after else "no observation after the last heal"
    return Verdict(
        "convergence",
        False,
        f"not converged within {bound_s:.0f}s after the last heal",
        [f"last observation: {why}"],
    )


# ----------------------------------------------------------------------------- 7. serving
# faults after which a retrying client must see no error for a non-streaming request
STRICT_SERVING_KINDS = frozenset({"gateway-kill", "gateway-pause", "backend-kill"})


def faults_active(faults: Sequence[FaultRecord], t: float) -> list[str]:
    return sorted({f.kind for f in faults if f.start <= t <= f.end})


def serving_errors(serve: Sequence[ServeOp], faults: Sequence[FaultRecord]) -> dict[str, dict[str, int]]:
    """Per fault kind ("none" when no fault was active): requests, errors, stream errors."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"requests": 0, "errors": 0, "stream_errors": 0})
    for s in serve:
        for k in faults_active(faults, s.start) or ["none"]:
            row = out[k]
            row["requests"] += 1
            if not s.ok:
                row["stream_errors" if s.stream else "errors"] += 1
    return dict(out)


def check_serving(serve: Sequence[ServeOp], faults: Sequence[FaultRecord]) -> Verdict:
    bad = []
    for s in serve:
        kinds = faults_active(faults, s.start)
        if not s.ok and not s.stream and kinds and set(kinds) <= STRICT_SERVING_KINDS:
            bad.append(
                f"non-streaming request at {s.start:.3f}s failed after {s.attempts} attempts"
                f" (last gateway {s.gateway}: {s.error}) while only {','.join(kinds)} was active"
            )
    table = serving_errors(serve, faults)
    total_err = sum(r["errors"] + r["stream_errors"] for r in table.values())
    if not serve:
        return Verdict("serving", False, "no request was sent through the gateways", [])
    return Verdict(
        "serving",
        not bad,
        f"{len(serve)} requests, {total_err} client-visible errors; {len(bad)} during gateway/single-backend faults",
        bad,
    )


def longest_gap(times_ok: Sequence[tuple[float, bool]]) -> tuple[float, float]:
    """The longest stretch (length, start) in which every call failed: from the end of the last
    success before it to the first success after it."""
    best, at = 0.0, 0.0
    last_ok: float | None = None
    failing_since: float | None = None
    for t, ok in sorted(times_ok):
        if ok:
            if failing_since is not None and last_ok is not None and t - last_ok > best:
                best, at = t - last_ok, last_ok
            last_ok, failing_since = t, None
        elif failing_since is None:
            failing_since = t
    return best, at
