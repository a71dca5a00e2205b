"""Stand-in `hy-smi` and `rocm-smi` (Hygon DTK): the rocm-smi style command line, JSON with --json.

Options: --showproductname, --showmeminfo vram|vis_vram|gtt, --showuse, --showmemuse, --showpower,
--showtemp, --showbus, --showserial, --json, -d/--device N... Unknown options are refused the way the
real (argparse based) tool refuses them: usage and "error: unrecognized arguments" on stderr, exit 2.

With --json it prints `{"card0": {...}}` with the keys of DTK releases: "Card Series", "vram Total Memory
(MiB)", "vram Total Used Memory (MiB)", "HCU use (%)" (hy-smi) or "DCU use (%)" (rocm-smi), "Average
Graphics Package Power (W)", "Temperature (Sensor edge|junction|mem) (C)" (junction = the state's
temperature, edge 3 °C lower, mem 2 °C higher), "PCI Bus". Values are strings, as the real tool prints
them. A chip whose health is Critical reads N/A (the only health these tools can show); Warning cannot be
shown and prints as healthy. Without --json it prints `HCU[0]\t\t: key: value` lines between banners.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Sequence
from typing import TextIO

from node_agent.plugins.standin import bus_number, present_chips
from node_agent.plugins.standin.state import SimChip

NA = "N/A"
VENDOR = "Chengdu Haiguang IC Design Co., Ltd."


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Hygon System Management Interface (stand-in)")
    parser.add_argument("-d", "--device", nargs="+", type=int, metavar="DEVICE")
    parser.add_argument("--showproductname", action="store_true")
    parser.add_argument("--showmeminfo", nargs="+", choices=["vram", "vis_vram", "gtt"], metavar="TYPE")
    parser.add_argument("--showuse", action="store_true")
    parser.add_argument("--showmemuse", action="store_true")
    parser.add_argument("--showpower", action="store_true")
    parser.add_argument("--showtemp", action="store_true")
    parser.add_argument("--showbus", action="store_true")
    parser.add_argument("--showserial", action="store_true")
    parser.add_argument("--json", action="store_true")
    return parser


def card_fields(chip: SimChip, args: argparse.Namespace, use_key: str) -> dict[str, str]:
    na = chip.health == "Critical"
    fields: dict[str, str] = {}
    if args.showproductname:
        fields.update({"Card Series": chip.model, "Card Vendor": VENDOR, "Device ID": "0x6210"})
    if args.showserial:
        fields["Serial Number"] = f"TKUNLUN{chip.index:08d}"
    if args.showtemp:
        t = chip.temperature_c
        fields["Temperature (Sensor edge) (C)"] = NA if na else f"{t - 3:.1f}"
        fields["Temperature (Sensor junction) (C)"] = NA if na else f"{t:.1f}"
        fields["Temperature (Sensor mem) (C)"] = NA if na else f"{t + 2:.1f}"
    if args.showpower:
        fields["Average Graphics Package Power (W)"] = NA if na else f"{chip.power_w:.1f}"
    if args.showuse:
        fields[use_key] = NA if na else f"{chip.utilization_pct:.1f}"
    if args.showmemuse:
        percent = chip.memory_used_mb * 100 // chip.memory_total_mb if chip.memory_total_mb else 0
        fields[use_key.replace("use", "memory use")] = NA if na else str(percent)
    if args.showmeminfo and "vram" in args.showmeminfo:
        fields["vram Total Memory (MiB)"] = NA if na else str(chip.memory_total_mb)
        fields["vram Total Used Memory (MiB)"] = NA if na else str(chip.memory_used_mb)
    if args.showbus:
        fields["PCI Bus"] = chip.bus_id or f"0000:{bus_number(chip.index).lower()}:00.0"
    return fields


def _main(
    prog: str, use_key: str, argv: Sequence[str], chips: list[SimChip] | None, out: TextIO, err: TextIO
) -> int:
    parser = _parser(prog)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            args = parser.parse_args(list(argv))
    except SystemExit as exc:
        return int(exc.code) if isinstance(exc.code, int) else 2
    if chips is None:
        err.write("ERROR:root:Driver not initialized (amdgpu not found in modules)\n")
        return 2
    selected = [c for c in present_chips(chips, "hygon") if args.device is None or c.index in args.device]
    cards = {f"card{chip.index}": card_fields(chip, args, use_key) for chip in selected}
    if args.json:
        out.write(json.dumps(cards) + "\n")
        return 0
    out.write("=" * 28 + " System Management Interface " + "=" * 29 + "\n")
    for name, fields in cards.items():
        for key, value in fields.items():
            out.write(f"HCU[{name[4:]}]\t\t: {key}: {value}\n")
    out.write("=" * 35 + " End of SMI Log " + "=" * 35 + "\n")
    return 0


def main_hy_smi(argv: Sequence[str], chips: list[SimChip] | None, out: TextIO, err: TextIO) -> int:
    return _main("hy-smi", "HCU use (%)", argv, chips, out, err)


def main_rocm_smi(argv: Sequence[str], chips: list[SimChip] | None, out: TextIO, err: TextIO) -> int:
    return _main("rocm-smi", "DCU use (%)", argv, chips, out, err)


TOOLS = {"hy-smi": main_hy_smi, "rocm-smi": main_rocm_smi}
