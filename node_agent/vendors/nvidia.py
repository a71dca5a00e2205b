"""NVIDIA: parse `nvidia-smi --query-gpu=... --format=csv,noheader,nounits` and `nvidia-smi -q`.

The CSV query gives the numbers, one line per GPU, in the order of QUERY_FIELDS:

    0, NVIDIA A100-SXM4-40GB, 40960, 4, 0, 22, 52.12

memory in MiB (counted as MB), utilization %, temperature °C, power W. Unavailable values print as
`[N/A]`, `N/A`, `[Not Supported]`...; they become None. nvidia-smi may print `WARNING: infoROM is
corrupted at gpu 0000:B3:00.0` among the lines and then exit with code 14; the lines are still used, and
that GPU's health is at least Warning. Exit code 6 with "No devices were found" means no GPUs: [].

`health` is not a --query-gpu field (nvidia-smi refuses it), so health comes from `nvidia-smi -q`, whose
GPU sections (`GPU 00000000:2F:00.0`) are matched to the CSV lines by order (both list the GPUs in index
order); the section's PCI bus id becomes `bus_id`. In a section:
    Critical - GPU Reset Status / Reset Required: Yes; Remapped Rows / Remapping Failure Occurred: Yes;
               a volatile uncorrectable ECC count above 0 (ECC Errors / Volatile / DRAM or SRAM
               Uncorrectable, or the Double Bit counters of older drivers); or a CSV value
               "[GPU requires reset]",
    Warning  - Remapped Rows / Pending: Yes; Retired Pages / Pending Page Blacklist (or Pending
               Retirement): Yes; GPU Reset Status / Drain and Reset Recommended: Yes; an infoROM warning,
    OK       - otherwise; Unknown when -q has no section for the GPU.
Temperature is reported, not judged: thermal slowdown does not change health.

Note: nvidia-smi numbers the GPUs it can see; when a GPU falls off the bus the ones after it shift down.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass

import structlog

from kunlun_common.messages import msg
from node_agent.vendors.base import (
    HEALTH_CRITICAL,
    HEALTH_OK,
    HEALTH_UNKNOWN,
    HEALTH_WARNING,
    ObservedDevice,
    VendorAdapter,
    parse_float,
    parse_int,
)
from node_agent.vendors.record import StandIn, Vendor, VendorRuntime

log = structlog.get_logger()

QUERY_FIELDS = (
    "index",
    "name",
    "memory.total",
    "memory.used",
    "utilization.gpu",
    "temperature.gpu",
    "power.draw",
)
RC_NO_DEVICES = 6
RC_INFOROM_CORRUPTED = 14
_SEVERITY = {HEALTH_UNKNOWN: -1, HEALTH_OK: 0, HEALTH_WARNING: 1, HEALTH_CRITICAL: 2}
_GPU_HEADER_RE = re.compile(r"^GPU\s+([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f])\s*$")
_KEY_VALUE_RE = re.compile(r"^(\s*)(\S.*?)\s*:\s*(.*?)\s*$")
_BUS_PARTS_RE = re.compile(r"^([0-9a-f]{1,8}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-9a-f])$")
_INFOROM_RE = re.compile(r"infoROM is corrupted at gpu\s+([0-9A-Fa-f:.]+)", re.IGNORECASE)


@dataclass(frozen=True)
class QueryRow:
    index: int
    name: str
    memory_total_mb: int | None
    memory_used_mb: int | None
    utilization_pct: float | None
    temperature_c: float | None
    power_w: float | None
    requires_reset: bool


@dataclass(frozen=True)
class GpuSection:
    bus_id: str
    health: str


def worse(a: str, b: str) -> str:
    return a if _SEVERITY[a] >= _SEVERITY[b] else b


def normalise_bus_id(bus_id: str) -> str:
    """Bus ids as nvidia-smi prints them in either width ("00000000:2F:00.0", "0000:2f:00.0"), comparable."""
    text = bus_id.strip().lower()
    m = _BUS_PARTS_RE.match(text)
    if m is None:
        return text
    return f"{int(m.group(1), 16):04x}:{m.group(2)}:{m.group(3)}.{m.group(4)}"


def parse_query_csv(text: str) -> tuple[list[QueryRow], list[str]]:
    """Parse the CSV query; returns the rows and the bus ids named by infoROM warnings."""
    rows: list[QueryRow] = []
    inforom: list[str] = []
    for line in text.splitlines():
        warning = _INFOROM_RE.search(line)
        if warning:
            inforom.append(warning.group(1).rstrip("."))
            continue
        if not line.strip():
            continue
        fields = next(csv.reader([line], skipinitialspace=True))
        index = parse_int(fields[0]) if fields else None
        if len(fields) != len(QUERY_FIELDS) or index is None or not fields[0].strip().isdigit():
            log.debug("nvidia_smi.skipped_line", line=line)
            continue
        values = [field.strip() for field in fields]
        rows.append(
            QueryRow(
                index=index,
                name=values[1],
                memory_total_mb=parse_int(values[2]),
                memory_used_mb=parse_int(values[3]),
                utilization_pct=parse_float(values[4]),
                temperature_c=parse_float(values[5]),
                power_w=parse_float(values[6]),
                requires_reset=any("requires reset" in value.lower() for value in values),
            )
        )
    return sorted(rows, key=lambda r: r.index), inforom


def _flatten(lines: list[str]) -> dict[str, str]:
    """Turn an indented `Key : Value` block into {"Section/Sub/Key": value}."""
    result: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in lines:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        prefix = "/".join(name for _, name in stack)
        kv = _KEY_VALUE_RE.match(line)
        if kv is not None and kv.group(3) != "":
            result[f"{prefix}/{kv.group(2)}" if prefix else kv.group(2)] = kv.group(3)
        else:
            stack.append((indent, kv.group(2) if kv is not None else line.strip()))
    return result


def _section_health(fields: dict[str, str]) -> str:
    def yes(key: str) -> bool:
        return fields.get(key, "").strip().lower() == "yes"

    volatile_uncorrectable = 0
    for key, value in fields.items():
        parts = key.split("/")
        if parts[:2] != ["ECC Errors", "Volatile"]:
            continue
        if "uncorrectable" in key.lower() or "Double Bit" in parts:
            volatile_uncorrectable += parse_int(value) or 0
    if (
        yes("GPU Reset Status/Reset Required")
        or yes("Remapped Rows/Remapping Failure Occurred")
        or volatile_uncorrectable > 0
    ):
        return HEALTH_CRITICAL
    if (
        yes("Remapped Rows/Pending")
        or yes("Retired Pages/Pending Page Blacklist")
        or yes("Retired Pages/Pending Retirement")
        or yes("GPU Reset Status/Drain and Reset Recommended")
    ):
        return HEALTH_WARNING
    return HEALTH_OK


def parse_nvsmi_log(text: str) -> list[GpuSection]:
    """Parse `nvidia-smi -q`: one GpuSection per `GPU <bus id>` section, in the order printed."""
    sections: list[GpuSection] = []
    bus_id: str | None = None
    lines: list[str] = []
    for line in [*text.splitlines(), "GPU END"]:
        header = _GPU_HEADER_RE.match(line)
        if header or line == "GPU END":
            if bus_id is not None:
                sections.append(GpuSection(bus_id=bus_id, health=_section_health(_flatten(lines))))
            bus_id, lines = (header.group(1) if header else None), []
        elif bus_id is not None:
            lines.append(line)
    return sections


def combine(rows: list[QueryRow], sections: list[GpuSection], inforom: list[str]) -> list[ObservedDevice]:
    warned = {normalise_bus_id(bus) for bus in inforom}
    devices: list[ObservedDevice] = []
    for position, row in enumerate(rows):
        section = sections[position] if position < len(sections) else None
        health = section.health if section else HEALTH_UNKNOWN
        if section and normalise_bus_id(section.bus_id) in warned:
            health = worse(health, HEALTH_WARNING)
        if row.requires_reset:
            health = HEALTH_CRITICAL
        devices.append(
            ObservedDevice(
                index=row.index,
                model=row.name,
                memory_total_mb=row.memory_total_mb,
                memory_used_mb=row.memory_used_mb,
                utilization_pct=row.utilization_pct,
                temperature_c=row.temperature_c,
                power_w=row.power_w,
                health=health,
                bus_id=section.bus_id if section else None,
            )
        )
    return devices


class NvidiaAdapter(VendorAdapter):
    device_type = "nvidia"
    tool = "nvidia-smi"

    def command(self) -> list[str]:
        return [self.tool, f"--query-gpu={','.join(QUERY_FIELDS)}", "--format=csv,noheader,nounits"]

    def health_command(self) -> list[str]:
        return [self.tool, "-q"]

    def discover(self) -> list[ObservedDevice]:
        self._start()
        command = self.command()
        ok = (0, RC_NO_DEVICES, RC_INFOROM_CORRUPTED)
        result = self._run(command, ok_returncodes=ok)
        if result.returncode == RC_NO_DEVICES:
            if "no devices were found" in result.stdout.lower():
                return []
            why = msg(
                "device.nvidia.no_devices_text",
                "exit code {code} without 'No devices were found'",
                code=RC_NO_DEVICES,
            )
            raise self._unparsable(command, why, "")
        rows, inforom = parse_query_csv(result.stdout)
        if not rows:
            raise self._unparsable(
                command, msg("device.tool.no_gpu_line", "no GPU line in the CSV"), result.stdout
            )
        health = self._run(self.health_command(), ok_returncodes=(0, RC_INFOROM_CORRUPTED))
        return combine(rows, parse_nvsmi_log(health.stdout), inforom)


VENDOR = Vendor(
    type_name="nvidia",
    aliases=("gpu", "cuda"),
    adapter=NvidiaAdapter,
    runtime=VendorRuntime(
        visible_env="CUDA_VISIBLE_DEVICES",
        device_node=lambda n: f"/dev/nvidia{n}",
        shared_nodes=("/dev/nvidiactl", "/dev/nvidia-uvm"),
        # No --device: CUDA is SGLang's default device (its quick start launches without the flag).
        sglang_args=(),
        cache_env=(("CUDA_CACHE_PATH", "cuda"),),
    ),
    standin=StandIn(module="nvidia_smi", tools=("nvidia-smi",)),
)
