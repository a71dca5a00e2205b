"""Iluvatar CoreX GPUs (MR-V50, MR-V100, BI-V100, BI-V150; supported by HAMi): parse `ixsmi --query-gpu`.

Command: `ixsmi --format=csv,noheader --query-gpu=index,name,memory.total,memory.used,utilization.gpu,
temperature.gpu` (ixsmi follows nvidia-smi's query interface). One line per GPU, with units, e.g.

    0, Iluvatar MR-V50, 16384 MiB, 116 MiB, 0 %, 30 C

memory in MiB (counted as MB), utilization %, temperature °C; the leading number of each value is taken and
unavailable values (`[N/A]`, `N/A`...) become None. "No devices were found" means no GPUs: []. The query has
no health or power field: health is Critical when a GPU is listed but neither its memory nor its
utilization can be read (it enumerates but does not answer), otherwise OK; power is not reported.

Runtime: the CoreX runtime is CUDA-compatible and honours CUDA_VISIBLE_DEVICES (Iluvatar's own container
scripts read it); each GPU is the device node /dev/iluvatarN (public deployments pass /dev/iluvatar0..7 to
containers), with no shared control node. N is the driver's minor number, which equals the ixsmi index on
a host whose GPUs all enumerate in order; where they differ the node id would need the tool's minor number
(as Ascend's physical id), which this query does not print. Upstream SGLang
has no Iluvatar device (its devices are CUDA, ROCm, NPU, XPU, HPU, MUSA and CPU, and its kernels are built
for NVIDIA), so `engine: sglang` is refused on this vendor (the reason is its line in
kunlun_common.names.VENDOR_NAMES); `engine: template` runs the vendor's own engine build.
"""

from __future__ import annotations

import csv

from kunlun_common.messages import msg
from node_agent.vendors.base import (
    HEALTH_CRITICAL,
    HEALTH_OK,
    ObservedDevice,
    VendorAdapter,
    parse_float,
    parse_int,
)
from node_agent.vendors.record import StandIn, Vendor, VendorRuntime

QUERY_FIELDS = ("index", "name", "memory.total", "memory.used", "utilization.gpu", "temperature.gpu")


def parse_ixsmi_csv(text: str) -> list[ObservedDevice]:
    """Parse the CSV query (see the module docstring); lines that are not a GPU line are skipped."""
    devices: list[ObservedDevice] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = [f.strip() for f in next(csv.reader([line], skipinitialspace=True))]
        if len(fields) != len(QUERY_FIELDS) or not fields[0].isdigit():
            continue
        total, used, utilization = parse_int(fields[2]), parse_int(fields[3]), parse_float(fields[4])
        devices.append(
            ObservedDevice(
                index=int(fields[0]),
                model=fields[1],
                memory_total_mb=total,
                memory_used_mb=used,
                utilization_pct=utilization,
                temperature_c=parse_float(fields[5]),
                power_w=None,
                health=HEALTH_CRITICAL
                if total is None and used is None and utilization is None
                else HEALTH_OK,
            )
        )
    return sorted(devices, key=lambda d: d.index)


class IluvatarAdapter(VendorAdapter):
    device_type = "iluvatar"
    tool = "ixsmi"

    def command(self) -> list[str]:
        return [self.tool, "--format=csv,noheader", f"--query-gpu={','.join(QUERY_FIELDS)}"]

    def discover(self) -> list[ObservedDevice]:
        self._start()
        command = self.command()
        result = self._run(command, ok_returncodes=(0, 6))
        if "no devices were found" in result.stdout.lower():
            return []
        devices = parse_ixsmi_csv(result.stdout)
        if not devices:
            raise self._unparsable(
                command, msg("device.tool.no_gpu_line", "no GPU line in the CSV"), result.stdout
            )
        return devices


VENDOR = Vendor(
    type_name="iluvatar",
    aliases=("corex", "ixgpu"),
    adapter=IluvatarAdapter,
    runtime=VendorRuntime(
        visible_env="CUDA_VISIBLE_DEVICES",
        device_node=lambda n: f"/dev/iluvatar{n}",
        shared_nodes=(),
    ),
    standin=StandIn(module="ixsmi", tools=("ixsmi",)),
)
