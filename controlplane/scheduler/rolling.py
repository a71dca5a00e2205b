"""Rolling replacement of a workload's instances after a spec change (a pure decision).

When a workload's generation moves on (`workload submit` with a changed spec, or a completed
rollout), its instances placed with an older generation are replaced a few at a time:

* a *successor* (an instance of the same ordinal, current generation, a new id) is created while the
  workload has fewer than `replicas + max_surge` instances;
* an old instance is taken out of service (`retiring`: gateways stop routing to it at once) only
  while at least `replicas - max_unavailable` other instances are serving, old ones whose
  successor already serves first; it is removed (its engine stopped) once it has drained for the
  drain period. An old instance that is not serving (starting, failed) is removed at once.

With the default policy (neither field set) the roll is surge-first (max_surge 1, max_unavailable
0) "where capacity allows": once a successor cannot be placed anywhere (it records unplaced
reasons), one instance may be unavailable, so the roll still ends on a full cluster or a pinned
device. An explicit policy is kept to the letter (a stuck successor then waits, and says so).

`decide_roll` is a function of plain values (`Member`s), unit-tested by hand; `rolling_units` turns
its decision into the leader's etcd units.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from controlplane.scheduler.actions import Unit, create_instance, remove_instance, retire_instance
from controlplane.store.contract import KV
from kunlun_common.api import workload_pb2
from kunlun_common.messages import msg
from kunlun_common.states import PLACED, InstancePhase

DEFAULT_MAX_SURGE = 1
DEFAULT_MAX_UNAVAILABLE = 0


@dataclass(frozen=True)
class RollPolicy:
    """How fast a workload's instances are replaced after a spec change."""

    max_surge: int = DEFAULT_MAX_SURGE
    """Instances allowed above `replicas` during the roll (successors started before old ones stop)."""
    max_unavailable: int = DEFAULT_MAX_UNAVAILABLE
    """Instances allowed below `replicas` serving during the roll."""
    defaulted: bool = True
    """Neither field was set: one instance may be unavailable when a successor cannot be placed."""

    @staticmethod
    def of(spec: workload_pb2.WorkloadSpec) -> RollPolicy:
        surge_set, unavail_set = spec.HasField("max_surge"), spec.HasField("max_unavailable")
        surge = spec.max_surge if surge_set else DEFAULT_MAX_SURGE
        if unavail_set:
            unavailable = spec.max_unavailable
        else:  # surge 0 needs room to make progress: one below
            unavailable = 1 if surge == 0 else DEFAULT_MAX_UNAVAILABLE
        return RollPolicy(max(0, surge), max(0, unavailable), not (surge_set or unavail_set))


@dataclass(frozen=True)
class Member:
    """One (non-canary) instance of the workload, as the roll sees it."""

    id: str
    ordinal: int
    generation: int
    phase: str
    """The phase as observed (the agent's report over the record)."""
    retiring: bool = False
    unplaceable: bool = False
    """Pending with reasons why no node fits it (the scheduler tried and failed)."""

    @property
    def serving(self) -> bool:
        return self.phase == InstancePhase.RUNNING and not self.retiring


@dataclass(frozen=True)
class RollDecision:
    create: tuple[int, ...] = ()
    """Ordinals that get a successor now."""
    retire: tuple[str, ...] = ()
    """Serving old instances taken out of routing now (removed after the drain)."""
    remove: tuple[str, ...] = ()
    """Instances removed now (drained, or not serving anyway)."""
    updated: int = 0
    """Ordinals whose current-generation successor is serving."""
    serving: int = 0
    """Instances serving (routable) before this decision."""
    waiting: str = ""
    """Why the roll cannot go on now (empty when it can)."""
    rolling: bool = False
    """Instances of an older generation (or extra ones) remain."""
    policy: RollPolicy = field(default_factory=RollPolicy)


def _current(m: Member, generation: int) -> bool:
    """Runs (or will run, once placed) the current spec: placement stamps the current generation."""
    return not m.retiring and (
        m.generation in (generation, 0) or m.phase == InstancePhase.PENDING  # 0: unknown (old records)
    )


def _rank(m: Member) -> tuple[int, int, str]:
    """The best successor of an ordinal first: serving, then placed, then the newest."""
    placed = m.phase in (InstancePhase.SCHEDULED, InstancePhase.STARTING, InstancePhase.RUNNING)
    return (0 if m.serving else 1, 0 if placed else 1, m.id)


def decide_roll(
    replicas: int,
    generation: int,
    members: Sequence[Member],
    policy: RollPolicy,
    drained: Collection[str] = (),
) -> RollDecision:
    """What to create, take out of routing and remove this tick (see the module docstring).

    `members` are the workload's non-canary instances with ordinal < replicas; `drained` the ids of
    retiring instances whose drain period has passed (the leader measures it on its own clock).
    """
    by_ordinal: dict[int, list[Member]] = {}
    for m in members:
        by_ordinal.setdefault(m.ordinal, []).append(m)
    successor: dict[int, Member] = {}
    retirees: list[Member] = []
    for ordinal, group in sorted(by_ordinal.items()):
        current = sorted((m for m in group if _current(m, generation)), key=_rank)
        if current:
            successor[ordinal] = current[0]
        retirees += [m for m in group if m is not (current[0] if current else None)]
    serving = sum(1 for m in members if m.serving)
    updated = sum(1 for m in successor.values() if m.serving and m.generation == generation)
    if not retirees:
        return RollDecision(updated=updated, serving=serving, policy=policy)
    stuck = sorted(o for o, m in successor.items() if m.unplaceable and any(r.ordinal == o for r in retirees))
    unavailable = policy.max_unavailable
    if policy.defaulted and stuck:
        unavailable = max(unavailable, 1)  # "where capacity allows": no room for a surge instance
    floor = replicas - unavailable
    remove: list[str] = []
    retire: list[str] = []
    for m in retirees:
        if m.retiring:
            if m.id in drained:
                remove.append(m.id)
        elif not m.serving:
            remove.append(m.id)  # serves nobody: nothing to drain, nothing to wait for

    def order(m: Member) -> tuple[int, int]:
        succ = successor.get(m.ordinal)
        if succ is not None and succ.serving:
            return (0, m.ordinal)
        return (1 if m.ordinal in stuck else 2, m.ordinal)

    left = serving
    for m in sorted((m for m in retirees if m.serving), key=order):
        if left - 1 < floor:
            break
        retire.append(m.id)
        left -= 1
    gone = set(remove)
    emptied = sum(1 for group in by_ordinal.values() if all(m.id in gone for m in group))
    total = len(members) - len(remove) + emptied  # the lifecycle refills an emptied ordinal at once
    create: list[int] = []
    for ordinal in sorted(by_ordinal):
        if ordinal in successor or all(m.id in gone for m in by_ordinal[ordinal]):
            continue  # has one; or is empty now (the lifecycle refills an empty ordinal)
        if total >= replicas + policy.max_surge:
            break
        create.append(ordinal)
        total += 1
    waiting = ""
    if not (create or retire or remove):
        if stuck and not policy.defaulted:
            waiting = f"successor of ordinal {stuck[0]} cannot be placed (max_unavailable {unavailable})"
        elif any(m.retiring for m in retirees):
            waiting = "draining"
        else:
            waiting = "waiting for new instances to serve"
    return RollDecision(
        create=tuple(create),
        retire=tuple(retire),
        remove=tuple(remove),
        updated=updated,
        serving=serving,
        waiting=waiting,
        rolling=True,
        policy=policy,
    )


def progress_text(replicas: int, d: RollDecision) -> str:
    """The line `workload describe` shows while a roll is under way ("" when none is)."""
    if not d.rolling:
        return ""
    p = d.policy
    text = (
        f"rolling: {d.updated}/{replicas} updated, {d.serving} serving "
        f"(max surge {p.max_surge}, max unavailable {p.max_unavailable}"
        f"{', defaults' if p.defaulted else ''})"
    )
    return text + (f"; {d.waiting}" if d.waiting else "")


def observed_phase(inst: workload_pb2.Instance, statuses: Mapping[str, tuple[str, str]]) -> str:
    """The phase its node reports for a placed instance (as `feeds.overlay` shows it), else the record's."""
    seen = statuses.get(inst.id)
    if seen is None or inst.phase not in PLACED or seen[0] != inst.node or not seen[1]:
        return inst.phase
    return inst.phase if seen[1] == InstancePhase.PENDING else seen[1]


def may_roll(w: workload_pb2.Workload, own: Sequence[workload_pb2.Instance]) -> bool:
    """Cheap test: could a roll have anything to do (an old, retiring or duplicate instance)?"""
    ordinals: set[int] = set()
    for inst in own:
        if inst.variant:
            continue
        if inst.retiring or inst.ordinal in ordinals:
            return True
        if inst.generation not in (w.generation, 0) and inst.phase != InstancePhase.PENDING:
            return True
        ordinals.add(inst.ordinal)
    return False


def rolling_progress(w: workload_pb2.Workload, instances: Sequence[workload_pb2.Instance]) -> str:
    """`WorkloadSummary.rolling` for instances whose phases are already the observed ones."""
    if w.deleting or not may_roll(w, instances):
        return ""
    d = decide_roll(w.spec.replicas, w.generation, members_of(w, instances), RollPolicy.of(w.spec))
    return progress_text(w.spec.replicas, d)


def members_of(
    w: workload_pb2.Workload,
    instances: Sequence[workload_pb2.Instance],
    statuses: Mapping[str, tuple[str, str]] | None = None,
) -> list[Member]:
    """The roll's view of a workload's baseline instances (`statuses`: what the nodes report)."""
    out = []
    for inst in instances:
        if inst.workload_id != w.id or inst.variant or inst.ordinal >= w.spec.replicas:
            continue
        out.append(
            Member(
                id=inst.id,
                ordinal=inst.ordinal,
                generation=inst.generation,
                phase=observed_phase(inst, statuses or {}),
                retiring=inst.retiring,
                unplaceable=inst.phase == InstancePhase.PENDING and bool(inst.unplaced_reasons),
            )
        )
    return out


def rolling_units(
    w: workload_pb2.Workload,
    w_kv: KV,
    own: Sequence[tuple[workload_pb2.Instance, KV]],
    statuses: Mapping[str, tuple[str, str]],
    allocs: dict[str, tuple[str, KV]],
    drained: Collection[str],
    by: str,
    revision: int,
) -> list[Unit]:
    """The leader's units for one workload's roll this tick (none when nothing is to be done)."""
    insts = [inst for inst, _ in own]
    if not may_roll(w, insts):
        return []
    d = decide_roll(
        w.spec.replicas, w.generation, members_of(w, insts, statuses), RollPolicy.of(w.spec), drained
    )
    records = {inst.id: (inst, kv) for inst, kv in own}
    units: list[Unit] = [create_instance(w, w_kv, o, by, revision, successor=True) for o in d.create]
    for iid in d.retire:
        inst, kv = records[iid]
        why = msg(
            "instance.retiring", "Retiring: replaced by generation {generation}", generation=w.generation
        )
        units.append(retire_instance(inst, kv, by, why))
    for iid in d.remove:
        inst, kv = records[iid]
        units.append(remove_instance(inst, kv, allocs))
    return units
