"""Stand-in `nvidia-smi`: `--query-gpu=... --format=csv[,noheader][,nounits]`, `-q`, `-L`, no arguments.

Like the real tool it refuses a field that is not a --query-gpu field (`health` included) with
`Field "health" is not a valid field to query.` and exit code 2, an unknown option with
`ERROR: Option <opt> is not recognized. Please run 'nvidia-smi -h'.` (exit 2), --format without a query
with `Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.` (exit 2); it prints
`No devices were found` (exit 6) when there are no GPUs, and the "couldn't communicate with the NVIDIA
driver" message (exit 9) when there is no simulator state. Messages go to stdout, as nvidia-smi does.

Valid fields that are not simulated print `[N/A]`. In CSV, utilization and temperature print as integers
and power with two decimals; memory in MiB. `-q` prints the NVSMI LOG sections the adapter reads (PCI bus
id, memory, utilization, ECC errors, retired pages, remapped rows, reset status, temperature, power), with
health shown in NVIDIA's terms: Warning = a row remapping pending; Critical = volatile uncorrectable DRAM
ECC errors, a remapping failure and "Reset Required: Yes". "HW Thermal Slowdown" turns Active at 89 °C.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TextIO

from node_agent.plugins.standin import bus_number, present_chips
from node_agent.plugins.standin.state import SimChip

DRIVER_VERSION = "535.129.03"
CUDA_VERSION = "12.2"
SLOWDOWN_TEMP_C = 89
DRIVER_MISSING = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running.\n\n"
)
INVALID_COMBINATION = "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n"
RC_INVALID_ARGUMENT = 2
RC_NOT_FOUND = 6
RC_DRIVER_NOT_LOADED = 9

# Field name -> (unit shown in the header and after the value, or "").
SIMULATED_FIELDS: dict[str, str] = {
    "index": "",
    "name": "",
    "gpu_name": "",
    "memory.total": "MiB",
    "memory.used": "MiB",
    "memory.free": "MiB",
    "utilization.gpu": "%",
    "temperature.gpu": "",
    "power.draw": "W",
    "pci.bus_id": "",
    "gpu_bus_id": "",
    "uuid": "",
    "gpu_uuid": "",
    "count": "",
    "driver_version": "",
}
# Real --query-gpu fields the stand-in does not simulate: accepted, printed as [N/A].
OTHER_VALID_FIELDS = frozenset(
    """timestamp serial gpu_serial pci.domain pci.bus pci.device pci.device_id pci.sub_device_id
    pcie.link.gen.current pcie.link.gen.max pcie.link.width.current pcie.link.width.max display_mode
    display_active persistence_mode accounting.mode accounting.buffer_size driver_model.current
    driver_model.pending vbios_version inforom.img inforom.oem inforom.ecc inforom.pwr gom.current
    gom.pending fan.speed pstate memory.reserved compute_mode compute_cap utilization.memory
    encoder.stats.sessionCount encoder.stats.averageFps encoder.stats.averageLatency ecc.mode.current
    ecc.mode.pending ecc.errors.corrected.volatile.total ecc.errors.uncorrected.volatile.total
    ecc.errors.corrected.aggregate.total ecc.errors.uncorrected.aggregate.total retired_pages.single_bit_ecc.count
    retired_pages.double_bit.count retired_pages.pending temperature.memory power.management power.limit
    enforced.power.limit power.default_limit power.min_limit power.max_limit clocks.current.graphics clocks.gr
    clocks.current.sm clocks.sm clocks.current.memory clocks.mem clocks.current.video clocks.video
    clocks.max.graphics clocks.max.gr clocks.max.sm clocks.max.memory clocks.max.mem mig.mode.current
    mig.mode.pending fabric.state fabric.status""".split()
)


def bus_id(chip: SimChip) -> str:
    return chip.bus_id or f"00000000:{bus_number(chip.index)}:00.0"


def _value(chip: SimChip, field: str, count: int, units: bool) -> str:
    unit = SIMULATED_FIELDS.get(field, "")
    raw: str
    if field == "index":
        raw = str(chip.index)
    elif field in ("name", "gpu_name"):
        raw = chip.model
    elif field == "memory.total":
        raw = str(chip.memory_total_mb)
    elif field == "memory.used":
        raw = str(chip.memory_used_mb)
    elif field == "memory.free":
        raw = str(chip.memory_total_mb - chip.memory_used_mb)
    elif field == "utilization.gpu":
        raw = str(round(chip.utilization_pct))
    elif field == "temperature.gpu":
        raw = str(round(chip.temperature_c))
    elif field == "power.draw":
        raw = f"{chip.power_w:.2f}"
    elif field in ("pci.bus_id", "gpu_bus_id"):
        raw = bus_id(chip)
    elif field in ("uuid", "gpu_uuid"):
        raw = f"GPU-{chip.index:08x}-0000-4000-8000-6b756e6c756e"
    elif field == "count":
        raw = str(count)
    elif field == "driver_version":
        raw = DRIVER_VERSION
    else:
        return "[N/A]"
    return f"{raw} {unit}" if units and unit else raw


def query_gpu(fields: list[str], fmt: set[str], gpus: list[SimChip]) -> str:
    lines: list[str] = []
    if "noheader" not in fmt:
        lines.append(
            ", ".join(f"{f} [{SIMULATED_FIELDS[f]}]" if SIMULATED_FIELDS.get(f) else f for f in fields)
        )
    units = "nounits" not in fmt
    for chip in gpus:
        lines.append(", ".join(_value(chip, f, len(gpus), units) for f in fields))
    return "\n".join(lines) + "\n"


def _kv(indent: int, key: str, value: str) -> str:
    return f"{' ' * indent}{key:<{42 - indent}}: {value}"


def query_log(gpus: list[SimChip]) -> str:
    lines = [
        "",
        "==============NVSMI LOG==============",
        "",
        _kv(0, "Timestamp", time.strftime("%a %b %d %H:%M:%S %Y")),
        _kv(0, "Driver Version", DRIVER_VERSION),
        _kv(0, "CUDA Version", CUDA_VERSION),
        "",
        _kv(0, "Attached GPUs", str(len(gpus))),
    ]
    for chip in gpus:
        warning, critical = chip.health == "Warning", chip.health == "Critical"
        uncorrectable = "2" if critical else "0"
        hot = "Active" if chip.temperature_c >= SLOWDOWN_TEMP_C else "Not Active"
        lines += [
            f"GPU {bus_id(chip)}",
            _kv(4, "Product Name", chip.model),
            _kv(4, "Product Brand", "NVIDIA"),
            _kv(4, "GPU UUID", _value(chip, "uuid", len(gpus), False)),
            _kv(4, "Minor Number", str(chip.index)),
            "    GPU Reset Status",
            _kv(8, "Reset Required", "Yes" if critical else "No"),
            _kv(8, "Drain and Reset Recommended", "No"),
            "    PCI",
            _kv(8, "Bus Id", bus_id(chip)),
            "    Clocks Event Reasons",
            _kv(8, "HW Slowdown", hot),
            _kv(12, "HW Thermal Slowdown", hot),
            "    FB Memory Usage",
            _kv(8, "Total", f"{chip.memory_total_mb} MiB"),
            _kv(8, "Reserved", "0 MiB"),
            _kv(8, "Used", f"{chip.memory_used_mb} MiB"),
            _kv(8, "Free", f"{chip.memory_total_mb - chip.memory_used_mb} MiB"),
            _kv(4, "Compute Mode", "Default"),
            "    Utilization",
            _kv(8, "Gpu", f"{round(chip.utilization_pct)} %"),
            "    ECC Mode",
            _kv(8, "Current", "Enabled"),
            _kv(8, "Pending", "Enabled"),
            "    ECC Errors",
            "        Volatile",
            _kv(12, "SRAM Correctable", "0"),
            _kv(12, "SRAM Uncorrectable", "0"),
            _kv(12, "DRAM Correctable", "0"),
            _kv(12, "DRAM Uncorrectable", uncorrectable),
            "        Aggregate",
            _kv(12, "SRAM Correctable", "0"),
            _kv(12, "SRAM Uncorrectable", "0"),
            _kv(12, "DRAM Correctable", "0"),
            _kv(12, "DRAM Uncorrectable", uncorrectable),
            "    Retired Pages",
            _kv(8, "Single Bit ECC", "N/A"),
            _kv(8, "Double Bit ECC", "N/A"),
            _kv(8, "Pending Page Blacklist", "N/A"),
            "    Remapped Rows",
            _kv(8, "Correctable Error", "0"),
            _kv(8, "Uncorrectable Error", "1" if (warning or critical) else "0"),
            _kv(8, "Pending", "Yes" if warning else "No"),
            _kv(8, "Remapping Failure Occurred", "Yes" if critical else "No"),
            "    Temperature",
            _kv(8, "GPU Current Temp", f"{round(chip.temperature_c)} C"),
            _kv(8, "GPU Shutdown Temp", "92 C"),
            _kv(8, "GPU Slowdown Temp", f"{SLOWDOWN_TEMP_C} C"),
            "    GPU Power Readings",
            _kv(8, "Power Draw", f"{chip.power_w:.2f} W"),
            _kv(4, "Processes", "None"),
            "",
        ]
    return "\n".join(lines) + "\n"


def summary(gpus: list[SimChip]) -> str:
    rule = "+-----------------------------------------+------------------------+----------------------+"
    lines = [
        "+" + "-" * 89 + "+",
        f"| NVIDIA-SMI {DRIVER_VERSION:<23}Driver Version: {DRIVER_VERSION:<15}CUDA Version: {CUDA_VERSION:<9}|",
        "|-----------------------------------------+------------------------+----------------------+",
        "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
        "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
        "|                                         |                        |               MIG M. |",
        "|=========================================+========================+======================|",
    ]
    for chip in gpus:
        ecc = "2" if chip.health == "Critical" else "0"
        name = chip.model if len(chip.model) <= 31 else chip.model[:28] + "..."
        usage = f"{round(chip.power_w)}W / {400:>4}W"
        memory = f"{chip.memory_used_mb}MiB / {chip.memory_total_mb:>6}MiB"
        lines += [
            f"|{chip.index:>4}  {name:<31}On  |{bus_id(chip):>19} Off |{ecc:>21} |",
            f"|{'N/A':>4}{round(chip.temperature_c):>5}C    P0{usage:>24} |{memory:>23} |"
            f"{round(chip.utilization_pct):>7}%      Default |",
            f"|{'':41}|{'':24}|{'Disabled':>21} |",
            rule,
        ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str], chips: list[SimChip] | None, out: TextIO, err: TextIO) -> int:
    query: list[str] | None = None
    fmt: set[str] | None = None
    full_log = listing = False
    only: int | None = None
    args = list(argv)
    position = 0
    while position < len(args):
        arg = args[position]
        name, eq, value = arg.partition("=")
        if name in ("--query-gpu", "--format", "-i", "--id") and not eq:
            if position + 1 >= len(args):
                out.write(INVALID_COMBINATION)
                return RC_INVALID_ARGUMENT
            position += 1
            value = args[position]
        if name == "--query-gpu":
            query = [field.strip() for field in value.split(",") if field.strip()]
        elif name == "--format":
            fmt = {part.strip() for part in value.split(",")}
        elif name in ("-i", "--id"):
            if not value.isdigit():
                out.write(INVALID_COMBINATION)
                return RC_INVALID_ARGUMENT
            only = int(value)
        elif arg in ("-q", "--query"):
            full_log = True
        elif arg in ("-L", "--list-gpus"):
            listing = True
        else:
            out.write(f"ERROR: Option {arg} is not recognized. Please run 'nvidia-smi -h'.\n")
            return RC_INVALID_ARGUMENT
        position += 1
    if (fmt is not None) != (query is not None) or (query is not None and (full_log or listing)):
        out.write(INVALID_COMBINATION)
        return RC_INVALID_ARGUMENT
    if query is not None:
        for field in query:
            if field not in SIMULATED_FIELDS and field not in OTHER_VALID_FIELDS:
                out.write(f'Field "{field}" is not a valid field to query.\n\n')
                return RC_INVALID_ARGUMENT
        if fmt is None or "csv" not in fmt or not fmt <= {"csv", "noheader", "nounits"}:
            out.write(INVALID_COMBINATION)
            return RC_INVALID_ARGUMENT
    if chips is None:
        out.write(DRIVER_MISSING)
        return RC_DRIVER_NOT_LOADED
    gpus = present_chips(chips, "nvidia")
    if only is not None:
        gpus = [chip for chip in gpus if chip.index == only]
    if not gpus:
        out.write("No devices were found\n")
        return RC_NOT_FOUND
    if query is not None and fmt is not None:
        out.write(query_gpu(query, fmt, gpus))
    elif full_log:
        out.write(query_log(gpus))
    elif listing:
        for chip in gpus:
            out.write(f"GPU {chip.index}: {chip.model} (UUID: {_value(chip, 'uuid', len(gpus), False)})\n")
    else:
        out.write(summary(gpus))
    return 0


TOOLS = {"nvidia-smi": main}
