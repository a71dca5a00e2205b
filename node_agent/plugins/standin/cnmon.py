"""Stand-in `cnmon`: `cnmon info [-e] [-m] [-u] [-p] [-c] -j` writes cnmon_info.json into the current
directory, as the real cnmon does in JSON mode, and prints nothing.

Per chip: CardNum, ProductName, UUID, PCI (DomainID/Bus/Device/Function, Current/Max Speed and Width),
PhysicalMemUsage (Total/Used/Free, MiB), Utilization.MLUAverage (integer %), Temperature (Board/Chip,
integer °C), Power.Usage (integer W). Health is shown the way cnmon can show it: "Warning" as a PCIe link
running below its capability (8 GT/s on a 16 GT/s link), "Critical" as a card whose metrics read N/A.

Only JSON mode is simulated: `cnmon info` without -j, and any other command or option, is refused (exit 1).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from node_agent.plugins.standin import bus_number, present_chips
from node_agent.plugins.standin.state import SimChip

JSON_FILE = "cnmon_info.json"
INFO_OPTIONS = {"-e", "-m", "-u", "-p", "-c", "-j"}
NA = "N/A"


def card_json(chip: SimChip) -> dict[str, Any]:
    bus = chip.bus_id.split(":") if chip.bus_id else ["0000", bus_number(chip.index).lower(), "00.0"]
    device, _, function = bus[-1].partition(".")
    critical = chip.health == "Critical"
    card: dict[str, Any] = {
        "CardNum": chip.index,
        "ProductName": chip.model,
        "UUID": f"MLU-{chip.index:08x}-kunlun-sim",
        "PCI": {
            "DomainID": bus[0],
            "Bus": bus[1],
            "Device": device,
            "Function": function or "0",
            "CurrentSpeed": "8 GT/s" if chip.health == "Warning" else "16 GT/s",
            "MaxSpeed": "16 GT/s",
            "CurrentWidth": "x16",
            "MaxWidth": "x16",
        },
        "PhysicalMemUsage": {
            "Total": NA if critical else chip.memory_total_mb,
            "Used": NA if critical else chip.memory_used_mb,
            "Free": NA if critical else chip.memory_total_mb - chip.memory_used_mb,
        },
        "Utilization": {"MLUAverage": NA if critical else round(chip.utilization_pct)},
        "Temperature": {
            "Board": NA if critical else round(chip.temperature_c) - 10,
            "Chip": NA if critical else round(chip.temperature_c),
        },
        "Power": {"Usage": NA if critical else round(chip.power_w)},
    }
    return card


def main(argv: Sequence[str], chips: list[SimChip] | None, out: TextIO, err: TextIO) -> int:
    args = list(argv)
    if not args or args[0] != "info" or any(a not in INFO_OPTIONS for a in args[1:]):
        bad = next((a for a in args[1:] if a not in INFO_OPTIONS), " ".join(args) or "<none>")
        err.write(f"cnmon: unknown command or option {bad!r} (Kunlun stand-in: only `cnmon info ... -j`)\n")
        return 1
    if "-j" not in args:
        err.write("cnmon: the Kunlun stand-in simulates JSON mode only; add -j\n")
        return 1
    if chips is None:
        err.write("cnmon: Cambricon driver not loaded (no simulator state)\n")
        return 1
    payload = {"CnmonInfo": [card_json(chip) for chip in present_chips(chips, "cambricon")]}
    target = Path(os.getcwd()) / JSON_FILE
    target.write_text(json.dumps(payload, indent=4) + "\n", encoding="utf-8")
    return 0


TOOLS = {"cnmon": main}
