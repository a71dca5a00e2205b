"""Which engine arguments are secret, and their redaction: shared by the replicas (what viewers
see in `workload describe`) and the agents (what supervisors and the test engine log)."""

from __future__ import annotations

import re

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
