"""Linearizability of the workload API, checked per workload name against a register model.

The search is Wing & Gong's with Lowe's memoisation (the algorithm behind Knossos and Porcupine):
walk the calls and returns in time order, tentatively linearize a call whose model step is legal,
backtrack when a return is reached whose call could not be placed, and remember every (set of
linearized calls, state) already explored. A step budget bounds the work; running out of it is
reported as "inconclusive", never as a pass.

The model of one name (a register with a slow delete):

    ""          absent             submit ok -> "r=N";   scale/delete/get NOT_FOUND
    "r=N"       live, N replicas   submit/scale ok -> "r=M";  delete ok -> "deleting"
    "deleting"  marked for delete  delete/scale ok stay; submit fails FAILED_PRECONDITION;
                                   at any moment the leader may finish it -> ""

A call with an unknown outcome may have taken effect at any time after it began, or never.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from chaos.history import FAILED, OK, UNKNOWN, ApiOp

ABSENT = ""
DELETING = "deleting"
# failures that say what the state was (the call had no effect, but it observed something)
OBSERVING_FAILURES = {"NOT_FOUND", "FAILED_PRECONDITION"}


def _live(state: str) -> bool:
    return state.startswith("r=")


def step(state: str, op: ApiOp) -> list[str]:
    """The states the register may be in after `op` from `state` (empty: `op` cannot happen here)."""
    pres = [state, ABSENT] if state == DELETING else [state]
    out: list[str] = []
    for pre in pres:
        out.extend(_apply(pre, op))
    if op.result == UNKNOWN and state not in out:
        out.append(state)  # it may never have taken effect
    return list(dict.fromkeys(out))


def _apply(pre: str, op: ApiOp) -> list[str]:
    if op.result in (OK, UNKNOWN):
        if op.kind == "submit":
            return [f"r={op.arg}"] if pre == ABSENT or _live(pre) else []
        if op.kind == "scale":
            if _live(pre):
                return [f"r={op.arg}"]
            return [DELETING] if pre == DELETING else []
        if op.kind == "delete":
            return [DELETING] if pre == DELETING or _live(pre) else []
        if op.kind == "get":
            return [pre] if pre == (op.read or ABSENT) else []
        return []
    # definite failures that observed the state
    if op.code == "NOT_FOUND":
        return [pre] if pre == ABSENT else []
    if op.code == "FAILED_PRECONDITION" and op.kind == "submit":
        return [pre] if pre == DELETING else []
    return [pre]


REGISTER_KINDS = frozenset({"submit", "scale", "delete", "get"})


def relevant(op: ApiOp) -> bool:
    """Calls that constrain the register (failures without information, unanswered reads and calls
    of other APIs, such as rollouts, drop out)."""
    if op.kind not in REGISTER_KINDS:
        return False
    if op.result == UNKNOWN:
        return op.kind != "get"
    if op.result == FAILED:
        return op.code in OBSERVING_FAILURES
    return op.result == OK


@dataclass(frozen=True)
class LinResult:
    """The verdict for one workload name."""

    name: str
    ok: bool | None
    """True: linearizable; False: not; None: the step budget ran out (inconclusive)."""
    ops: int
    steps: int
    detail: str = ""


def check_name(name: str, ops: Sequence[ApiOp], budget: int = 200_000) -> LinResult:
    """Check one name's history (calls of other names are ignored)."""
    hist = [o for o in ops if o.name == name and relevant(o)]
    n = len(hist)
    if n == 0:
        return LinResult(name, True, 0, 0)
    # entries: (time, is_return, op index); calls sort before returns at the same instant
    events = sorted(
        [(o.start, 0, i) for i, o in enumerate(hist)] + [(o.end, 1, i) for i, o in enumerate(hist)],
        key=lambda e: (e[0], e[1], e[2]),
    )
    m = len(events)
    nxt = [*range(1, m + 1), -1]  # index m is the tail sentinel; -1 stands for the head
    prv = [-1, *range(m)]
    head_next = 0
    ret_pos = {ev[2]: p for p, ev in enumerate(events) if ev[1] == 1}

    def unlink(p: int) -> None:
        nonlocal head_next
        a, b = prv[p], nxt[p]
        if a == -1:
            head_next = b
        else:
            nxt[a] = b
        prv[b] = a

    def relink(p: int) -> None:
        nonlocal head_next
        a, b = prv[p], nxt[p]
        if a == -1:
            head_next = p
        else:
            nxt[a] = p
        prv[b] = p

    state = ABSENT
    linearized = 0
    seen: set[tuple[int, str]] = set()
    stack: list[tuple[int, str, int]] = []  # (call position, state before, alternative used)
    entry, alt_from = head_next, 0
    steps, deepest, stuck_at = 0, 0, -1
    while head_next != m:
        steps += 1
        if steps > budget:
            return LinResult(name, None, n, steps, f"step budget {budget} exhausted at depth {len(stack)}")
        _t, is_ret, i = events[entry]
        if not is_ret:
            alts = step(state, hist[i])
            chosen = -1
            for k in range(alt_from, len(alts)):
                key = (linearized | (1 << i), alts[k])
                if key not in seen:
                    seen.add(key)
                    chosen = k
                    break
            alt_from = 0
            if chosen >= 0:
                stack.append((entry, state, chosen))
                state = alts[chosen]
                linearized |= 1 << i
                unlink(entry)
                unlink(ret_pos[i])
                entry = head_next
                if len(stack) > deepest:
                    deepest, stuck_at = len(stack), -1
            else:
                entry = nxt[entry]
        else:
            if len(stack) == deepest and stuck_at < 0:
                stuck_at = i
            if not stack:
                return _violation(name, hist, steps, deepest, stuck_at)
            call_pos, state, k = stack.pop()
            ci = events[call_pos][2]
            linearized &= ~(1 << ci)
            relink(ret_pos[ci])
            relink(call_pos)
            entry, alt_from = call_pos, k + 1
    return LinResult(name, True, n, steps)


def _violation(name: str, hist: list[ApiOp], steps: int, deepest: int, stuck_at: int) -> LinResult:
    o = hist[stuck_at] if stuck_at >= 0 else hist[0]
    end = "never" if math.isinf(o.end) else f"{o.end:.3f}s"
    what = f"{o.kind}({o.arg})" if o.arg is not None else o.kind
    got = f" read {o.read!r}" if o.kind == "get" else ""
    return LinResult(
        name,
        False,
        len(hist),
        steps,
        f"no legal order: after {deepest} of {len(hist)} calls, client {o.client}'s {what}"
        f" [{o.start:.3f}s .. {end}] {o.result}{(' ' + o.code) if o.code else ''}{got} fits nowhere",
    )


def check_all(ops: Sequence[ApiOp], budget_per_name: int = 200_000) -> list[LinResult]:
    """Check every workload name of a history."""
    by_name: dict[str, list[ApiOp]] = defaultdict(list)
    for o in ops:
        by_name[o.name].append(o)
    return [check_name(name, v, budget_per_name) for name, v in sorted(by_name.items())]
