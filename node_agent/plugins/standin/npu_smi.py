"""Stand-in `npu-smi`: prints the `npu-smi info` table from the simulator state.

The layout follows the chips' model (of the lowest-index present chip):
    "Ascend910" (Atlas A3)   `Chip Phy-ID` layout, two chips per NPU (NPU = index // 2, chip = index % 2,
                             Phy-ID = index); the second chip's power prints "-", as on the real tool
    "310"                    `Chip Device` layout, four chips per NPU id (Atlas 300I model 3000)
    other "310..." (310P3)   `Chip Device` layout, one chip per NPU id, power "NA" (as 310P cards print)
    anything else (910B3...) `Chip` layout with HBM-Usage, one chip per NPU id, NPU id = index
Memory goes to HBM-Usage on 910 layouts (Memory-Usage then shows 0 / 0) and to Memory-Usage on 310
layouts. Temperature and AICore(%) print as integers, power with one decimal. Health prints as OK,
Warning or Critical. A process table with "No running processes found" lines follows, as on real machines.

`npu-smi info -m` prints the chip mapping (NPU ID, Chip ID, Chip Logic ID = the chip's index, Chip Name).
Only these two are simulated; anything else is refused with exit code 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

from node_agent.plugins.standin import bus_number, present_chips
from node_agent.plugins.standin.state import SimChip

VERSION = "23.0.rc3"
WIDTH = 98
_LINE = "+" + "-" * 27 + "+" + "-" * 15 + "+" + "-" * 52 + "+"
_DOUBLE = "+" + "=" * 27 + "+" + "=" * 15 + "+" + "=" * 52 + "+"
_FULL = "+" + "-" * (WIDTH - 2) + "+"
DRIVER_MISSING = (
    "DrvMngGetConsoleLogLevel failed. (g_conLogLevel=3)\n"
    "dcmi model initialized failed, because the device is used. ret is -8020\n"
)


@dataclass(frozen=True)
class Layout:
    chips_per_npu: int
    id_column: str | None  # "Phy-ID", "Device" or None
    hbm: bool
    power_na: bool


def layout_for(model: str) -> Layout:
    name = model.strip().lower()
    if name == "ascend910":
        return Layout(chips_per_npu=2, id_column="Phy-ID", hbm=True, power_na=False)
    if name == "310":
        return Layout(chips_per_npu=4, id_column="Device", hbm=False, power_na=False)
    if name.startswith("310"):
        return Layout(chips_per_npu=1, id_column="Device", hbm=False, power_na=True)
    return Layout(chips_per_npu=1, id_column=None, hbm=True, power_na=False)


def _row(first: str, second: str, third: str) -> str:
    return f"| {first:<26}| {second:<14}| {third:<51}|"


def _pair(used: object, total: object, width: int) -> str:
    return f"{used!s:<5}/ {total!s:<{width}}"


def render_info(chips: list[SimChip]) -> str:
    ascend = present_chips(chips, "ascend")
    layout = layout_for(ascend[0].model) if ascend else layout_for("")
    ids = f"Chip  {layout.id_column}" if layout.id_column else "Chip"
    memory_header = "Memory-Usage(MB)  HBM-Usage(MB)" if layout.hbm else "Memory-Usage(MB)"
    lines = [
        _FULL,
        f"| {'npu-smi ' + VERSION:<33}{'Version: ' + VERSION:<62}|",
        _LINE,
        _row("NPU   Name", "Health", "Power(W)    Temp(C)           Hugepages-Usage(page)"),
        _row(ids, "Bus-Id", f"AICore(%)   {memory_header}"),
        _DOUBLE,
    ]
    npu_ids: list[int] = []
    previous_npu: int | None = None
    for chip in ascend:
        npu_id, chip_id = divmod(chip.index, layout.chips_per_npu)
        if previous_npu is not None:
            lines.append(_FULL if npu_id == previous_npu else _DOUBLE)
        if npu_id not in npu_ids:
            npu_ids.append(npu_id)
        previous_npu = npu_id
        if layout.power_na:
            power = "NA"
        elif layout.chips_per_npu == 2 and chip_id == 1:
            power = "-"
        else:
            power = f"{chip.power_w:.1f}"
        lines.append(
            _row(
                f"{npu_id:<6}{chip.model}", chip.health, f"{power:<12}{round(chip.temperature_c):<18}0    / 0"
            )
        )
        bus = chip.bus_id or f"0000:{bus_number(chip.index)}:00.0"
        chip_cell = f"{chip_id:<6}{chip.index}" if layout.id_column else str(chip_id)
        if layout.hbm:
            memory = _pair(0, 0, 11) + _pair(chip.memory_used_mb, chip.memory_total_mb, 14)
        else:
            memory = _pair(chip.memory_used_mb, chip.memory_total_mb, 32)
        lines.append(_row(chip_cell, bus, f"{round(chip.utilization_pct):<12}{memory}"))
    lines.append(_DOUBLE)
    lines += [
        _LINE,
        _row("NPU     Chip", "Process id", "Process name             | Process memory(MB)"),
        _DOUBLE,
    ]
    for npu_id in npu_ids:
        lines.append(f"| {'No running processes found in NPU ' + str(npu_id):<95}|")
        lines.append(_DOUBLE)
    return "\n".join(lines) + "\n"


def render_mapping(chips: list[SimChip]) -> str:
    """`npu-smi info -m`: NPU ID, Chip ID, Chip Logic ID (the chip's index) and Chip Name per chip."""
    ascend = present_chips(chips, "ascend")
    layout = layout_for(ascend[0].model) if ascend else layout_for("")
    lines = [f"{'NPU ID':<31}{'Chip ID':<31}{'Chip Logic ID':<31}Chip Name"]
    for chip in ascend:
        npu_id, chip_id = divmod(chip.index, layout.chips_per_npu)
        lines.append(f"{npu_id:<31}{chip_id:<31}{chip.index:<31}{chip.model}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str], chips: list[SimChip] | None, out: TextIO, err: TextIO) -> int:
    if list(argv) == ["info", "-m"] and chips is not None:
        out.write(render_mapping(chips))
        return 0
    if list(argv) != ["info"]:
        out.write(
            f"Command error: `npu-smi {' '.join(argv)}` is not supported by the Kunlun npu-smi stand-in "
            "(only `npu-smi info` and `npu-smi info -m` are simulated).\n"
        )
        return 1
    if chips is None:
        out.write(DRIVER_MISSING)
        return 1
    out.write(render_info(chips))
    return 0


TOOLS = {"npu-smi": main}
