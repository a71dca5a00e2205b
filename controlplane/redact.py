"""Secrets in workload specs are shown to operators only.

Every `env` value, and every engine argument that is marked secret (the value after, or attached
to, a flag whose name says key, token, secret or password), is replaced by REDACTED for any other
role (viewers, replicas), so `workload describe` as a viewer shows names, never values.
"""

from __future__ import annotations

import re

from kunlun_common.api import workload_pb2
from kunlun_common.tls import Identity

REDACTED = "<redacted>"
SECRET_FLAG_RE = re.compile(
    r"^--?[A-Za-z0-9_-]*(key|token|secret|password|passwd|credential)[A-Za-z0-9_-]*$", re.I
)


def redact_args(args: list[str]) -> list[str]:
    """Engine arguments with the values of secret flags replaced (`--api-key X`, `--api-key=X`)."""
    out: list[str] = []
    hide_next = False
    for a in args:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        flag, eq, _ = a.partition("=")
        if SECRET_FLAG_RE.match(flag):
            if eq:
                out.append(f"{flag}={REDACTED}")
            else:
                out.append(a)
                hide_next = True
        else:
            out.append(a)
    return out


def workload_for(who: Identity, w: workload_pb2.Workload) -> workload_pb2.Workload:
    """`w` as `who` may see it: unchanged for operators, secrets redacted for everyone else."""
    if who.role == "operator":
        return w
    out = workload_pb2.Workload()
    out.CopyFrom(w)
    for k in list(out.spec.env):  # a copy: setting values while iterating a map can skip keys
        out.spec.env[k] = REDACTED
    redacted = redact_args(list(out.spec.engine_args))
    del out.spec.engine_args[:]
    out.spec.engine_args.extend(redacted)
    return out
