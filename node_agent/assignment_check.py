"""Checks on what a replica sends an agent, before anything of it becomes a path or a process.

An instance or workload id becomes a folder name under the node's state folder (and is removed
recursively when the instance goes), so a hostile or buggy replica must not be able to name
`..`, an absolute path or a separator. Items that fail are dropped (and logged) — the rest of the
set is still applied, as the replica meant. Items naming a shared spec get their own copy here, so
the rest of the agent sees every item with its spec whichever form the replica sent.
"""

from __future__ import annotations

import re

import structlog

from kunlun_common.api import agent_pb2
from kunlun_common.names import parse_device_name

log = structlog.get_logger("assignments")
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
"""Instance and workload ids: letters, digits, '_' and '-', starting with a letter or digit (no
'.', so never `.` or `..`; no '/')."""


def id_problem(what: str, value: str) -> str:
    """Why `value` cannot be an id that becomes a path ('' if it can)."""
    if ID_RE.match(value):
        return ""
    return f"{what} {value[:80]!r} is not a valid id (expected letters, digits, '_' or '-', at most 128)"


def assignment_problems(a: agent_pb2.Assignment) -> list[str]:
    """Everything wrong with one assignment item (empty when it is safe to act on)."""
    problems = [
        p for p in (id_problem("instance_id", a.instance_id), id_problem("workload_id", a.workload_id)) if p
    ]
    for d in a.devices:
        try:
            parse_device_name(d)
        except ValueError as e:
            problems.append(str(e))
    return problems


def safe_assignments(msg: agent_pb2.Assignments) -> agent_pb2.Assignments:
    """`msg` without the items that fail `assignment_problems` (each logged), every item carrying
    its spec: one that names a shared spec (`spec_ref`, see RegisterNode.shared_specs) gets it from
    the set's `specs`, and one naming a spec the set lacks is dropped like any bad item."""
    keep = []
    for a in msg.items:
        problems = assignment_problems(a)
        if a.spec_ref and a.spec_ref not in msg.specs:
            problems.append(f"spec_ref {a.spec_ref[:80]!r} names no spec of the set")
        if problems:
            log.warning("assignment refused", instance=a.instance_id[:80], problems=problems)
        elif a.spec_ref:
            item = agent_pb2.Assignment()
            item.CopyFrom(a)
            item.spec.CopyFrom(msg.specs[a.spec_ref])
            item.ClearField("spec_ref")
            keep.append(item)
        else:
            keep.append(a)
    if len(keep) == len(msg.items) and not msg.specs:
        return msg
    return agent_pb2.Assignments(items=keep, revision=msg.revision, cluster_id=msg.cluster_id)
