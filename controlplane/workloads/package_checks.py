"""Submit-time checks of a workload on a model package, against the store index and the devices.

Every reason is returned at once; the API refuses the spec (nothing written) when there is any:
the package is not in the cluster store (or its name differs); the engine cannot load its weight
format; no candidate device (by preferred types, pin and the package's target device types) lists
the quantization in its `supported_dtypes`; every candidate's HBM is below the package's minimum
device memory divided by `devices_per_instance` (tensor parallelism splits the weights).
"""

from __future__ import annotations

import math

from controlplane import keys
from controlplane.graph import load_nodes
from controlplane.package_store import PACKAGES
from controlplane.store import EtcdStore
from controlplane.workloads.spec import PACKAGE_RE, PIN_RE
from kunlun_common.api import types_pb2, workload_pb2
from kunlun_common.messages import Message, msg
from kunlun_common.modelpkg.weights import engine_problem


def _candidate(spec: workload_pb2.WorkloadSpec, targets: list[str], d: types_pb2.Device) -> bool:
    if spec.preferred_device_types and d.device_type not in spec.preferred_device_types:
        return False
    if targets and d.device_type not in targets:
        return False
    pin = PIN_RE.match(spec.pin) if spec.pin else None
    if pin is not None:
        if pin["type"] != d.device_type or (pin["node"] and pin["node"] != d.node):
            return False
        if pin["index"] is not None and int(pin["index"]) != d.index:
            return False
    return True


async def package_problems(store: EtcdStore, spec: workload_pb2.WorkloadSpec) -> list[Message]:
    m = PACKAGE_RE.match(spec.package) if spec.package else None
    if m is None:
        return []
    ref = spec.package
    hexd = ref.rsplit(":", 1)[1]
    kv = await store.get(PACKAGES + hexd)
    if kv is None:
        return [
            msg(
                "workload.package.package_not_cluster_store",
                "package: {ref} is not in the cluster store; push it with `kunlun-cli model push FILE`",
                ref=ref,
            )
        ]
    rec = keys.decode(kv.value)
    problems: list[Message] = []
    if rec.get("name") != m["name"]:
        problems.append(
            msg(
                "workload.package.package_store_has_digest",
                "package: the store has digest {digest}… as {stored!r}, not {name!r}",
                digest=hexd[:12],
                stored=rec.get("name"),
                name=m["name"],
            )
        )
    why = engine_problem(spec.engine or "sglang", str(rec.get("weight_format", "")))
    if why:
        problems.append(msg("workload.package.engine", "engine: {why}", why=why))
    targets = [str(t) for t in rec.get("target_device_types", [])]
    devices = [d for n in await load_nodes(store) for d in n.devices if _candidate(spec, targets, d)]
    if not devices:
        kinds = ", ".join(sorted({*spec.preferred_device_types, *targets})) or "any"
        return [
            *problems,
            msg(
                "workload.package.devices_no_device_type",
                "devices: no device of type {kinds} in the cluster to run {ref}",
                kinds=kinds,
                ref=ref,
            ),
        ]
    quant = spec.quantization if spec.quantization not in ("", "none") else str(rec.get("quantization") or "")
    if quant and not any(quant in d.supported_dtypes for d in devices):
        offered = sorted({t for d in devices for t in d.supported_dtypes})
        problems.append(
            msg(
                "workload.package.quantization_no_candidate_device",
                "quantization: {quant} is in no candidate device's supported_dtypes (they offer {items}); choose another quantization or device type",
                quant=quant,
                items=", ".join(offered),
            )
        )
    need = math.ceil(int(rec.get("min_device_memory_mb", 0)) / max(1, spec.devices_per_instance))
    if all(d.hbm_memory_mb < need for d in devices):
        biggest = max(d.hbm_memory_mb for d in devices)
        problems.append(
            msg(
                "workload.package.memory_package_needs_mib",
                "memory: the package needs {need} MiB per device and the largest candidate has {biggest} MiB; quantize further, raise devices_per_instance, or add larger devices",
                need=need,
                biggest=biggest,
            )
        )
    return problems
