"""`kunlun-cli workload submit|list|describe|scale|logs|delete`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from controlplane.cli.client import CliError
from controlplane.cli.output import print_json, print_table
from controlplane.cli.views import shown_reason
from controlplane.scheduler.reasons import node_reason_message
from controlplane.workloads.spec import SpecError, parse_spec_yaml, spec_json
from kunlun_common.api import workload_pb2
from kunlun_common.i18n import _, error_text, localize, pgettext
from kunlun_common.messages import from_stored


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    w = sub.add_parser(
        "workload", help="inference workloads (submit, list, describe, scale, delete)", parents=[common]
    )
    ws = w.add_subparsers(dest="cmd", required=True)
    s = ws.add_parser(
        "submit", help="submit a workload from a YAML spec or flags (idempotent)", parents=[common]
    )
    s.add_argument("-f", "--file", help="spec YAML (WorkloadSpec fields)")
    s.add_argument("--name")
    s.add_argument("--model")
    s.add_argument("--engine", help="sglang (default) or template")
    s.add_argument("--command-template")
    s.add_argument("--device", dest="pin", help="pin: TYPE:INDEX (ascend:0) or NODE/TYPE:INDEX")
    s.add_argument("--quantization", help="none, w8a8, int8, fp8, int4")
    s.add_argument("--dtype", help="fp16, bf16, fp32, auto")
    s.add_argument("--devices-per-instance", type=int)
    s.add_argument("--memory-per-device-mb", type=int)
    s.add_argument("--replicas", type=int)
    s.add_argument("--priority", choices=["high", "normal", "low"])
    s.add_argument("--preferred-device-types", help="comma-separated, in order, e.g. cambricon,ascend")
    s.add_argument("--batch-size", type=int)
    s.add_argument("--max-concurrency", type=int)
    s.add_argument("--require-p2p", action="store_true", default=None)
    s.add_argument("--dry-run", action="store_true", help="check and show where it would land; write nothing")
    s.add_argument("--package", help="model package NAME@sha256:DIGEST from the cluster store (`model list`)")
    s.set_defaults(handler=submit)
    ls = ws.add_parser("list", help="ID NAME PHASE INSTANCES TARGET AGE", parents=[common])
    ls.set_defaults(handler=list_workloads)
    d = ws.add_parser(
        "describe", help="spec, instances with target devices, history, reasons", parents=[common]
    )
    d.add_argument("name", help="name or id")
    d.set_defaults(handler=describe)
    sc = ws.add_parser("scale", help="set the number of instances", parents=[common])
    sc.add_argument("name")
    sc.add_argument("replicas", type=int)
    sc.set_defaults(handler=scale)
    lg = ws.add_parser("logs", help="an instance's engine logs, streamed from its node", parents=[common])
    lg.add_argument("name", help="name or id")
    lg.add_argument("--instance", type=int, default=0, help="instance ordinal (default 0)")
    lg.add_argument("--tail", type=int, default=0, help="only the last N lines")
    lg.add_argument("-f", "--follow", action="store_true", help="keep streaming new lines")
    lg.set_defaults(handler=logs)
    de = ws.add_parser("delete", help="delete a workload and its instances", parents=[common])
    de.add_argument("name")
    de.add_argument("--wait", action="store_true", help="wait until it is gone")
    de.set_defaults(handler=delete)


def _client(args: argparse.Namespace) -> Any:
    from controlplane.cli.main import make_client

    return make_client(args)


def build_spec(args: argparse.Namespace) -> workload_pb2.WorkloadSpec:
    spec = workload_pb2.WorkloadSpec()
    if args.file:
        try:
            text = Path(args.file).read_text()
        except OSError as e:
            raise CliError(
                _("{file}: cannot be read ({strerror})").format(file=args.file, strerror=e.strerror)
            ) from None
        try:
            spec = parse_spec_yaml(text, args.file)
        except SpecError as e:
            raise CliError(error_text(e).replace("\n", " ")) from None
    for flag in (
        "name",
        "model",
        "engine",
        "command_template",
        "pin",
        "quantization",
        "dtype",
        "priority",
        "package",
    ):
        v = getattr(args, flag)
        if v is not None:
            setattr(spec, flag, v)
    for flag in ("devices_per_instance", "memory_per_device_mb", "replicas", "batch_size", "max_concurrency"):
        v = getattr(args, flag)
        if v is not None:
            setattr(spec, flag, v)
    if args.require_p2p:
        spec.require_p2p = True
    if args.preferred_device_types:
        del spec.preferred_device_types[:]
        spec.preferred_device_types.extend(
            t.strip() for t in args.preferred_device_types.split(",") if t.strip()
        )
    if not args.file and not spec.model and not spec.package:
        raise CliError(_("give a spec file (-f spec.yaml) or at least --model (or --package)"))
    return spec


def submit(args: argparse.Namespace) -> int:
    client = _client(args)
    resp = client.workloads(
        lambda s: s.SubmitWorkload,
        workload_pb2.SubmitWorkloadRequest(
            spec=build_spec(args), dry_run=bool(getattr(args, "dry_run", False))
        ),
    )
    w = resp.workload
    if resp.result == "dry-run":
        if args.output == "json":
            print_json(
                {"name": w.spec.name, "result": "dry-run", "plan": list(resp.plan), "spec": spec_json(w.spec)}
            )
        else:
            print(_("workload {name}: dry run, nothing written; spec valid").format(name=w.spec.name))
            stored = list(resp.plan_messages) if len(resp.plan_messages) == len(resp.plan) else []
            for n, line in enumerate(resp.plan):
                m = from_stored(stored[n], line) if stored else None  # an older replica: its English lines
                print("  " + (localize(m, line) if m is not None else line))
        return 0
    if args.output == "json":
        print_json(
            {
                "id": w.id,
                "name": w.spec.name,
                "result": resp.result,
                "generation": w.generation,
                "spec": spec_json(w.spec),
            }
        )
    else:
        print(
            _("workload {name} ({id}) {result}").format(
                name=w.spec.name, id=w.id, result=submit_results().get(resp.result, resp.result)
            )
        )
    return 0


def submit_results() -> dict[str, str]:
    """What a submit did (the response's `result`, kept as it is in `-o json`), in the reader's language."""
    return {
        "created": pgettext("submit result", "created"),
        "updated": pgettext("submit result", "updated"),
        "unchanged": pgettext("submit result", "unchanged"),
    }


def spec_labels() -> dict[str, str]:
    """The labels `workload describe` shows before each spec field, by its JSON key, in the reader's
    language (in English: the key itself, as always)."""
    return {
        "name": pgettext("spec", "name"),
        "model": pgettext("spec", "model"),
        "engine": pgettext("spec", "engine"),
        "command_template": pgettext("spec", "command_template"),
        "quantization": pgettext("spec", "quantization"),
        "dtype": pgettext("spec", "dtype"),
        "devices_per_instance": pgettext("spec", "devices_per_instance"),
        "memory_per_device_mb": pgettext("spec", "memory_per_device_mb"),
        "replicas": pgettext("spec", "replicas"),
        "priority": pgettext("spec", "priority"),
        "preferred_device_types": pgettext("spec", "preferred_device_types"),
        "pin": pgettext("spec", "pin"),
        "max_concurrency": pgettext("spec", "max_concurrency"),
        "batch_size": pgettext("spec", "batch_size"),
        "require_p2p": pgettext("spec", "require_p2p"),
        "engine_args": pgettext("spec", "engine_args"),
        "env": pgettext("spec", "env"),
        "package": pgettext("spec", "package"),
        "fencing": pgettext("spec", "fencing"),
        "max_surge": pgettext("spec", "max_surge"),
        "max_unavailable": pgettext("spec", "max_unavailable"),
    }


def _history_line(h: dict[str, Any], event: workload_pb2.PhaseEvent) -> str:
    at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["at_unix_ms"] / 1000))
    return _("{at}  {phase:<10} by {by}  {reason}").format(
        at=at, phase=h["phase"], by=h["by"], reason=shown_reason(event)
    )


def _age(ms: int) -> str:
    s = max(0, int(time.time() - ms / 1000))
    return f"{s}s" if s < 120 else f"{s // 60}m" if s < 7200 else f"{s // 3600}h"


def instance_json(i: workload_pb2.Instance) -> dict[str, Any]:
    return {
        "id": i.id,
        "ordinal": i.ordinal,
        "phase": i.phase,
        "reason": i.reason,
        "generation": i.generation,
        "retiring": i.retiring,
        "node": i.node,
        "target_devices": list(i.target_devices),
        "endpoint": i.endpoint,
        "pid": i.pid,
        "restarts": i.restarts,
        "exit_code": i.exit_code,
        "launch_plan": {
            "command": list(i.launch_command),
            "env_names": list(i.launch_env_names),
            "device_nodes": list(i.launch_device_nodes),
        },
        "prepare_seconds": round(i.prepare_seconds, 3),
        "first_token_ms": round(i.first_token_ms, 1),
        "unplaced_reasons": dict(sorted(i.unplaced_reasons.items())),
        "history": [
            {"phase": h.phase, "at_unix_ms": h.at_unix_ms, "by": h.by, "reason": h.reason} for h in i.history
        ],
    }


def summary_json(s: workload_pb2.WorkloadSummary) -> dict[str, Any]:
    w = s.workload
    return {
        "id": w.id,
        "name": w.spec.name,
        "phase": s.phase,
        "rolling": s.rolling,
        "instances": len(s.instances),
        "replicas": w.spec.replicas,
        "target": sorted(d for i in s.instances for d in i.target_devices),
        "generation": w.generation,
        "created_at_unix_ms": w.created_at_unix_ms,
        "created_by": w.created_by,
        "updated_by": w.updated_by,
        "spec": spec_json(w.spec),
        "history": [
            {"phase": h.phase, "at_unix_ms": h.at_unix_ms, "by": h.by, "reason": h.reason} for h in w.history
        ],
        "instance_details": [instance_json(i) for i in s.instances],
        "load_balance": {
            "devices": s.load_balance.devices,
            "mean_utilization": round(s.load_balance.mean, 4),
            "stddev": round(s.load_balance.stddev, 4),
            "max_min": round(s.load_balance.max_min, 4),
        },
    }


def list_workloads(args: argparse.Namespace) -> int:
    items = [summary_json(s) for s in _client(args).all_workloads()]
    if args.output == "json":
        print_json({"items": items})
        return 0
    print_table(
        ["ID", "NAME", "PHASE", "INSTANCES", "TARGET", "AGE"],
        [
            [
                w["id"],
                w["name"],
                w["phase"],
                f"{sum(1 for i in w['instance_details'] if i['target_devices'])}/{w['replicas']}",
                ",".join(w["target"]) or "-",
                _age(w["created_at_unix_ms"]),
            ]
            for w in items
        ],
    )
    return 0


def describe(args: argparse.Namespace) -> int:
    s = _client(args).workloads(lambda st: st.GetWorkload, workload_pb2.GetWorkloadRequest(name=args.name))
    d = summary_json(s)
    if args.output == "json":
        print_json(d)
        return 0
    print(
        _("Name:        {name}\nID:          {id}\nPhase:       {phase}\nGeneration:  {generation}").format(
            name=d["name"], id=d["id"], phase=d["phase"], generation=d["generation"]
        )
    )
    print(
        _("Created by:  {created_by}   updated by: {updated_by}").format(
            created_by=d["created_by"], updated_by=d["updated_by"]
        )
    )
    if d["rolling"]:
        print(_("Update:      {rolling}").format(rolling=d["rolling"]))
    lb = d["load_balance"]
    if lb["devices"]:
        print(
            _(
                "Load balance: utilization across {devices} devices: mean {value:.1f}%, std dev {value2:.1f}%, max-min {value3:.1f}%"
            ).format(
                devices=lb["devices"],
                value=lb["mean_utilization"] * 100,
                value2=lb["stddev"] * 100,
                value3=lb["max_min"] * 100,
            )
        )
    print(_("Spec:"))
    labels = spec_labels()
    for k, v in d["spec"].items():
        if v not in ("", 0, [], {}, False, None) or (v == 0 and k in ("max_surge", "max_unavailable")):
            print(_("  {label}: {value}").format(label=labels.get(k, k), value=v))
    print(_("Instances:"))
    for i, inst in zip(d["instance_details"], s.instances, strict=True):
        print(
            _("  {id}  {phase}{value}  gen {generation}  target_devices: [{items}]  {reason}").format(
                id=i["id"],
                phase=i["phase"],
                value=_(" (retiring)") if i["retiring"] else "",
                generation=i["generation"],
                items=", ".join(i["target_devices"]),
                reason=shown_reason(inst),
            )
        )
        for node, why in i["unplaced_reasons"].items():
            print("      " + localize(node_reason_message(node, why)))
        if i["endpoint"]:
            print(
                _("      endpoint: {endpoint}  pid: {pid}  restarts: {restarts}").format(
                    endpoint=i["endpoint"], pid=i["pid"], restarts=i["restarts"]
                )
            )
        plan = i["launch_plan"]
        if plan["command"]:
            print(_("      launch: {items}").format(items=" ".join(plan["command"])))
            print(_("      env: {items}").format(items=", ".join(plan["env_names"])))
            print(_("      devices: {value}").format(value=", ".join(plan["device_nodes"]) or "-"))
        if i["prepare_seconds"] or i["first_token_ms"]:
            print(
                _("      prepared in {prepare_seconds}s, first token {first_token_ms} ms").format(
                    prepare_seconds=i["prepare_seconds"], first_token_ms=i["first_token_ms"]
                )
            )
        for h, event in list(zip(i["history"], inst.history, strict=True))[-5:]:
            print("      " + _history_line(h, event))
    print(_("History:"))
    for h, event in zip(d["history"], s.workload.history, strict=True):
        print("  " + _history_line(h, event))
    return 0


def scale(args: argparse.Namespace) -> int:
    resp = _client(args).workloads(
        lambda s: s.ScaleWorkload, workload_pb2.ScaleWorkloadRequest(name=args.name, replicas=args.replicas)
    )
    if args.output == "json":
        print_json(
            {"id": resp.workload.id, "name": resp.workload.spec.name, "replicas": resp.workload.spec.replicas}
        )
    else:
        print(
            _("workload {name} scaled to {replicas}").format(
                name=resp.workload.spec.name, replicas=resp.workload.spec.replicas
            )
        )
    return 0


def delete(args: argparse.Namespace) -> int:
    client = _client(args)
    resp = client.workloads(lambda s: s.DeleteWorkload, workload_pb2.DeleteWorkloadRequest(name=args.name))
    if args.wait:
        end = time.monotonic() + 60
        while time.monotonic() < end:
            names = {s.workload.id for s in client.all_workloads()}
            if resp.id not in names:
                break
            time.sleep(0.5)
        else:
            raise CliError(
                _(
                    "workload {name} is still being deleted after 60s; see `kunlun-cli workload describe {name}`"
                ).format(name=args.name)
            )
    if args.output == "json":
        print_json({"id": resp.id, "deleted": True})
    else:
        print(
            _("workload {name} ({id}) deleted").format(name=args.name, id=resp.id)
            if args.wait
            else _("workload {name} ({id}) is being deleted").format(name=args.name, id=resp.id)
        )
    return 0


def logs(args: argparse.Namespace) -> int:
    client = _client(args)
    req = workload_pb2.WorkloadLogsRequest(
        name=args.name, instance=args.instance, tail=args.tail, follow=args.follow
    )
    import grpc

    errors: list[str] = []
    for ep in client.cfg.endpoints:
        why = client.refused(ep)
        if why:
            errors.append(f"{ep}: {why}")
            continue
        with grpc.secure_channel(ep, client.creds) as ch:
            from kunlun_common.api import workload_pb2_grpc

            stream = workload_pb2_grpc.WorkloadServiceStub(ch).Logs(req, timeout=None if args.follow else 60)
            try:
                for chunk in stream:
                    for line in chunk.lines:
                        sys.stdout.write(line if line.endswith("\n") else line + "\n")
                    sys.stdout.flush()
                return 0
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.UNAVAILABLE,) and "node" not in (e.details() or ""):
                    errors.append(f"{ep}: {e.details()}")
                    continue
                raise CliError(f"{ep}: {e.code().name.lower().replace('_', ' ')}: {e.details()}") from None
    raise CliError(_("no replica answered ({items})").format(items="; ".join(errors)))
