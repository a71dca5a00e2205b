"""Stand-in `ixsmi` (Iluvatar CoreX): answers the CSV query the adapter runs, from the simulator state.

`ixsmi --format=csv,noheader --query-gpu=<fields>` (either order) prints one line per present iluvatar chip
with units, as the real tool does ("0, Iluvatar MR-V50, 16384 MiB, 116 MiB, 0 %, 30 C"). Fields other than
index, name, memory.total, memory.used, utilization.gpu and temperature.gpu, other formats and other
arguments are refused with exit code 2; no chips prints "No devices were found" (exit code 6).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TextIO

from node_agent.plugins.standin import present_chips
from node_agent.plugins.standin.state import SimChip

FIELDS = ("index", "name", "memory.total", "memory.used", "utilization.gpu", "temperature.gpu")


def _value(chip: SimChip, field: str) -> str:
    return {
        "index": str(chip.index),
        "name": chip.model,
        "memory.total": f"{chip.memory_total_mb} MiB",
        "memory.used": f"{chip.memory_used_mb} MiB",
        "utilization.gpu": f"{round(chip.utilization_pct)} %",
        "temperature.gpu": f"{round(chip.temperature_c)} C",
    }[field]


def main(argv: Sequence[str], chips: list[SimChip] | None, out: TextIO, err: TextIO) -> int:
    args = list(argv)
    query = [a for a in args if a.startswith("--query-gpu=")]
    fmt = [a for a in args if a.startswith("--format=")]
    if len(args) != 2 or len(query) != 1 or fmt != ["--format=csv,noheader"]:
        err.write(f"ixsmi: arguments not supported by the Kunlun stand-in: {' '.join(args)}\n")
        return 2
    fields = query[0].partition("=")[2].split(",")
    unknown = [f for f in fields if f not in FIELDS]
    if unknown:
        out.write(f'Field "{unknown[0]}" is not a valid field to query.\n\n')
        return 2
    if chips is None:
        err.write("ixsmi: failed to initialize: the driver is not loaded\n")
        return 9
    gpus = present_chips(chips, "iluvatar")
    if not gpus:
        out.write("No devices were found\n")
        return 6
    for chip in gpus:
        out.write(", ".join(_value(chip, f) for f in fields) + "\n")
    return 0


TOOLS = {"ixsmi": main}
