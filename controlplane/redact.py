"""Secrets in workload specs are shown to operators only.

Every `env` value, and every engine argument that is marked secret (the value after, or attached
to, a flag whose name says key, token, secret or password), is replaced by REDACTED for any other
role (viewers, replicas), so `workload describe` as a viewer shows names, never values: in the
workload's spec, in the specs its instances were placed with and in their launch commands.
"""

from __future__ import annotations

from kunlun_common.api import workload_pb2
from kunlun_common.secrets import REDACTED, SECRET_FLAG_RE, redact_args
from kunlun_common.tls import Identity

__all__ = ["REDACTED", "SECRET_FLAG_RE", "redact_args", "redact_spec", "workload_for"]


def redact_spec(spec: workload_pb2.WorkloadSpec) -> None:
    """Replace, in place, every env value and every secret engine argument of `spec`."""
    for k in list(spec.env):  # a copy: setting values while iterating a map can skip keys
        spec.env[k] = REDACTED
    redacted = redact_args(list(spec.engine_args))
    del spec.engine_args[:]
    spec.engine_args.extend(redacted)


def workload_for(who: Identity, w: workload_pb2.Workload) -> workload_pb2.Workload:
    """`w` as `who` may see it: unchanged for operators, secrets redacted for everyone else."""
    if who.role == "operator":
        return w
    out = workload_pb2.Workload()
    out.CopyFrom(w)
    redact_spec(out.spec)
    return out


def instances_for(
    who: Identity, w: workload_pb2.Workload, instances: list[workload_pb2.Instance]
) -> list[workload_pb2.Instance]:
    """`instances` (the caller's copies, changed in place) as `who` may see them next to `w`: the spec
    an instance was placed with is left out when it is the workload's current one (replicas aside),
    since the summary carries that once, in the workload; one that differs (an instance of an older
    generation during a rolling update, a canary) is kept, its secrets redacted like the workload's,
    and so are the secret arguments of the launch command the node reported."""
    current = workload_pb2.WorkloadSpec()
    current.CopyFrom(w.spec)
    current.ClearField("replicas")
    for inst in instances:
        if who.role != "operator":  # the node's launch plan: the engine's argv, secrets and all
            redacted = redact_args(list(inst.launch_command))
            del inst.launch_command[:]
            inst.launch_command.extend(redacted)
        if not inst.HasField("spec"):
            continue
        inst.spec.ClearField("replicas")
        if inst.spec == current:
            inst.ClearField("spec")
        elif who.role != "operator":
            redact_spec(inst.spec)
    return instances
