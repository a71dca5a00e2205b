"""Layer 5, high availability and canary (only with --disruptive).

One test workload on a free card gets a canary rollout at 10 % (steps [10, 100], moved on only by
promote). Then one replica (`--replica`, default the leader) is drained through the operator call
(`kunlun-cli cluster replica drain`): it hands leadership over, sends its agents and gateways to
other replicas and exits 0, and its service manager starts it again. While it is away
`workload list` is read again and again through the other replicas and must hold every workload of
before; the layer waits (bounded) until the replica serves again with a new process. Then a
bounded burst through a gateway and the canary checkpoints (controlplane/cli/verify/canary.py).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field

from controlplane.cli import replica_cmd
from controlplane.cli.client import CliError
from controlplane.cli.verify import canary
from controlplane.cli.verify.api import NAME_PREFIX, Api, test_workload
from controlplane.cli.verify.common import Options, free_ready, held_by, metrics_evidence, text_table
from controlplane.cli.verify.deploy import deploy
from controlplane.cli.verify.model import Evidence, LayerResult, evidence
from kunlun_common.api import cluster_pb2
from kunlun_common.i18n import _
from kunlun_common.messages import Message, msg, msg_list, plain

HANDOVER_LIMIT_MS = 10_000
"""Another replica must lead this soon after the drain call (two leader lease TTLs and more)."""
RESTART_TIMEOUT_S = 90.0
"""How long the layer waits for the drained replica to serve again (service manager restart delay,
Python start, etcd reconnect)."""
MOVED_TIMEOUT_S = 30.0
"""How long agents and gateways may take to be seen on other replicas after the drain."""


@dataclass
class Watch:
    """What the layer saw, read after read, from the drain answer until the replica was back."""

    reads: int = 0
    complete_reads: int = 0
    reads_while_away: int = 0
    """Reads made while the drained process was still registered as exiting or not yet replaced."""
    missing: Counter[str] = field(default_factory=Counter)
    no_answer: dict[str, Message] = field(default_factory=dict)
    """The entries of `missing` that stand for a read no replica answered, as messages."""
    gone_after_s: float | None = None
    back: cluster_pb2.ReplicaInfo | None = None
    back_after_s: float = 0.0
    moved_after_s: float | None = None
    placement: str = ""
    not_ready: Counter[str] = field(default_factory=Counter)
    log: list[Message] = field(default_factory=list)


def no_answer(w: Watch, e: CliError) -> str:
    """The entry of `w.missing` for a read that no replica answered (the CLI's error, already in the
    reader's language, cut to 120 characters), noted in `w.no_answer` as a message."""
    why = str(e)[:120]
    text = f"(no answer: {why})"
    w.no_answer.setdefault(text, msg("verify.l5.no_answer", "(no answer: {error})", error=plain(why)))
    return text


def missing_names(w: Watch) -> Message:
    """`NAME xCOUNT, ...` of what the reads missed (the workloads, and the reads nobody answered)."""
    return msg_list(
        "verify.l5.missing_names",
        "{parts}",
        [
            msg("verify.l5.missing_name", "{name} x{count}", name=w.no_answer.get(n, n), count=c)
            for n, c in w.missing.items()
        ],
        bullet="",
        sep=", ",
    )


def status_evidence(status: dict[str, cluster_pb2.ReplicaInfo], leader: str) -> Evidence:
    rows = [(r.name, r.address, r.pid, "*" if r.name == leader else "") for r in status.values()]
    return evidence("kunlun-cli cluster status", text_table(["REPLICA", "ADDRESS", "PID", "LEADER"], rows))


def refuse_busy(api: Api, opts: Options, r: LayerResult) -> bool:
    """Layer 5 drains a replica and sends a burst through the shared gateways: it runs only on a
    cluster that serves no workload of others, unless --allow-busy."""
    rows = api.metrics()
    held = {m.device: m.workload for m in rows if m.workload and not m.workload.startswith(NAME_PREFIX)}
    if not held or opts.allow_busy:
        return False
    r.add(
        "the cluster serves no workload of others",
        held_by(held),
        msg(
            "verify.l5.busy_threshold", "no card held by a workload this run did not create (or --allow-busy)"
        ),
        False,
        metrics_evidence(rows, ""),
        note="refused: layer 5 drains a replica and sends a burst through the gateways that serve them",
    )
    return True


def run(api: Api, opts: Options) -> LayerResult:
    r = LayerResult(5, "High availability and canary")
    if refuse_busy(api, opts, r):
        return r
    status = replica_cmd.replicas(api.client)
    leader = api.leader()
    target = opts.replica or leader
    if target not in status:
        raise CliError(
            _("--replica {name}: not registered (replicas: {names})").format(
                name=target, names=", ".join(sorted(status))
            )
        )
    if len(status) < 2:
        raise CliError(_("layer 5 needs at least 2 replicas: draining the only one stops the API"))
    free = free_ready(api)
    types = Counter(m.device_type for m in free)
    if not types or types.most_common(1)[0][1] < 2:
        raise CliError(_("layer 5 needs 2 free Ready cards of one type (baseline and canary instance)"))
    dtype = types.most_common(1)[0][0]
    spec = test_workload(api.name("l5"), replicas=1, preferred_device_types=[dtype])
    d = deploy(api, spec, opts.ready_timeout_s)
    plan = canary.start(api, spec.name, opts)
    drain_checkpoints(api, r, target, leader, status)
    canary.measure(api, r, d, spec.name, plan, opts)
    return r


def drain_checkpoints(
    api: Api, r: LayerResult, target: str, leader: str, status: dict[str, cluster_pb2.ReplicaInfo]
) -> None:
    before_names = {s.workload.spec.name for s in api.client.all_workloads()}
    before_ev = status_evidence(status, leader)
    on_target = [n.name for n in api.nodes() if n.connected_replica == target] + [
        g.name for g in api.gateways() if g.replica == target
    ]
    t0 = time.monotonic()
    old, resp = replica_cmd.drain(api.client, target)
    answered_s = time.monotonic() - t0
    drain_ev = evidence(
        f"kunlun-cli cluster replica drain {target} -o json",
        json.dumps(
            {
                "name": resp.name,
                "pid": resp.pid,
                "was_leader": resp.was_leader,
                "leader": resp.leader,
                "handover_ms": resp.handover_ms,
                "streams_ended": resp.streams_ended,
            },
            indent=1,
        ),
    )
    w = watch(api, target, resp.pid or old.pid, before_names, t0)
    exited = w.gone_after_s is not None and resp.pid == old.pid
    r.add(
        "replica drained through the operator call and exited",
        msg(
            "verify.l5.drained",
            "{target} (pid {pid}, {role}) answered in {answered_s:.1f} s, {streams} agent/gateway streams "
            "sent elsewhere; {left}",
            target=target,
            pid=resp.pid,
            role=msg("verify.l5.leader", "leader")
            if resp.was_leader
            else msg("verify.l5.follower", "follower"),
            answered_s=answered_s,
            streams=resp.streams_ended,
            left=(
                msg(
                    "verify.l5.left",
                    "left the registry {after_s:.1f} s after the call",
                    after_s=w.gone_after_s,
                )
                if exited
                else msg("verify.l5.not_left", "did NOT leave the registry")
            ),
        ),
        msg("verify.l5.drained_threshold", "answers the drain, then its process exits"),
        exited,
        before_ev,
        drain_ev,
    )
    if resp.was_leader:
        r.add(
            "leadership handed over",
            msg(
                "verify.l5.handover",
                "{leader} leads {handover_ms} ms after the call",
                leader=resp.leader or msg("verify.l5.nobody", "nobody"),
                handover_ms=resp.handover_ms,
            ),
            msg(
                "verify.l5.handover_threshold",
                "another replica leads within {limit_s} s",
                limit_s=HANDOVER_LIMIT_MS // 1000,
            ),
            bool(resp.leader) and resp.leader != target and resp.handover_ms <= HANDOVER_LIMIT_MS,
            drain_ev,
        )
    else:
        now = api.leader()
        r.add(
            "leadership unchanged (a follower was drained)",
            msg(
                "verify.l5.leader_now",
                "{now} leads (was {leader})",
                now=now or msg("verify.l5.nobody", "nobody"),
                leader=leader,
            ),
            msg("verify.l5.still_leads", "{leader} still leads", leader=leader),
            now == leader,
            drain_ev,
        )
    log_ev = evidence(
        msg("verify.ev.watch_log", "kunlun-cli workload list; kunlun-cli cluster status (every 0.5 s)"),
        msg_list("verify.l5.log", "{parts}", w.log[-40:], bullet="", sep="\n"),
    )
    r.add(
        "workload list complete while the replica was away",
        msg_list(
            "verify.l5.reads",
            "{complete}/{reads} reads held all {count} workloads ({away} of them before the new process "
            "served){parts}",
            [
                msg(
                    "verify.l5.missing",
                    "; missing: {names}",
                    names=missing_names(w),
                )
            ]
            if w.missing
            else [],
            bullet="",
            sep="",
            complete=w.complete_reads,
            reads=w.reads,
            count=len(before_names),
            away=w.reads_while_away,
        ),
        msg(
            "verify.l5.reads_threshold",
            "every read holds the {count} workloads of before; at least one read while away",
            count=len(before_names),
        ),
        w.reads > 0 and w.complete_reads == w.reads and w.reads_while_away > 0,
        log_ev,
    )
    r.add(
        "agents and gateways moved to other replicas",
        msg_list(
            "verify.l5.moved",
            "on {target} before: {before}; {parts}",
            [
                (
                    msg(
                        "verify.l5.moved_after",
                        "after {after_s:.1f} s: {placement}",
                        after_s=w.moved_after_s,
                        placement=w.placement,
                    )
                    if w.moved_after_s is not None
                    else msg("verify.l5.not_moved", "not seen: {placement}", placement=w.placement)
                ),
                *(
                    [
                        msg(
                            "verify.l5.not_ready",
                            "; NotReady seen: {nodes}",
                            nodes=", ".join(f"{n} x{c}" for n, c in w.not_ready.items()),
                        )
                    ]
                    if w.not_ready
                    else []
                ),
            ],
            bullet="",
            sep="",
            target=target,
            before=", ".join(on_target) or msg("verify.none", "none"),
        ),
        msg(
            "verify.l5.moved_threshold",
            "no agent or gateway on {target} within {timeout_s:.0f} s, every node Ready throughout",
            target=target,
            timeout_s=MOVED_TIMEOUT_S,
        ),
        w.moved_after_s is not None and not w.not_ready,
        log_ev,
    )
    back = w.back
    r.add(
        "the replica restarted",
        msg(
            "verify.l5.back",
            "{target} serves again as pid {pid} (was {old_pid}) {after_s:.1f} s after the call",
            target=target,
            pid=back.pid,
            old_pid=old.pid,
            after_s=w.back_after_s,
        )
        if back is not None
        else msg(
            "verify.l5.not_back",
            "{target} did not serve again within {timeout_s:.0f} s",
            target=target,
            timeout_s=RESTART_TIMEOUT_S,
        ),
        msg(
            "verify.l5.back_threshold",
            "a new process serving within {timeout_s:.0f} s (its service manager restarts it)",
            timeout_s=RESTART_TIMEOUT_S,
        ),
        back is not None and back.pid != old.pid,
        status_evidence(replica_cmd.replicas(api.client), api.leader()),
    )


def watch(api: Api, target: str, old_pid: int, names: set[str], t0: float) -> Watch:
    """Read `workload list`, the replicas, nodes and gateways every 0.5 s until `target` serves
    again with another pid and nothing is on it any more (bounded by RESTART_TIMEOUT_S)."""
    w = Watch()
    deadline = t0 + RESTART_TIMEOUT_S
    while time.monotonic() < deadline:
        at = time.monotonic() - t0
        try:
            listed = {s.workload.spec.name for s in api.client.all_workloads()}
            missing = names - listed
        except CliError as e:  # no replica answered: as incomplete as a list can be
            listed, missing = set(), {no_answer(w, e)}
        w.reads += 1
        w.complete_reads += not missing
        w.missing.update(missing)
        reps = replica_cmd.replicas(api.client)
        info = reps.get(target)
        if w.gone_after_s is None and (info is None or info.pid != old_pid):
            w.gone_after_s = at
        if w.back is None:
            w.reads_while_away += 1
        nodes = api.nodes()
        w.not_ready.update(n.name for n in nodes if not n.ready)
        gws = api.gateways()
        on = [n.name for n in nodes if n.connected_replica == target] + [
            g.name for g in gws if g.replica == target
        ]
        w.placement = ", ".join(
            [f"{n.name} -> {n.connected_replica or '-'}" for n in nodes]
            + [f"{g.name} -> {g.replica or '-'}" for g in gws]
        )
        if w.moved_after_s is None and not on and (w.gone_after_s is not None):
            w.moved_after_s = at
        w.log.append(
            msg(
                "verify.l5.log_line",
                "+{at:5.1f} s  workloads {seen}/{count}  {target}: {state}  [{placement}]",
                at=at,
                seen=len(listed & names),
                count=len(names),
                target=target,
                state=(
                    msg("verify.l5.pid", "pid {pid}", pid=info.pid)
                    if info
                    else msg("verify.l5.not_registered", "not registered")
                ),
                placement=w.placement,
            )
        )
        if (
            w.back is None
            and info is not None
            and info.pid != old_pid
            and replica_cmd.serving(api.client, info.address)
        ):
            w.back, w.back_after_s = info, at
        if w.back is not None and (w.moved_after_s is not None or at > MOVED_TIMEOUT_S):
            break
        time.sleep(0.5)
    return w
