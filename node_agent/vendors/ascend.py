"""Huawei Ascend: parse `npu-smi info` and `npu-smi info -m`.

The table prints every chip as two rows, after a two-row header:

    | NPU   Name      | Health   | Power(W)   Temp(C)          Hugepages-Usage(page) |
    | Chip  [Device]  | Bus-Id   | AICore(%)  Memory-Usage(MB) [HBM-Usage(MB)]       |
    | 0     910B3     | OK       | 95.7       36               0    / 0              |
    | 0               | 0000:C1:00.0 | 0      0    / 0         3161 / 65536          |

The second header row names the chip's id columns: `Chip` alone (Atlas 800 A2, 910A/910B: one chip per
NPU), `Chip Device` (Atlas 300I/300I Pro/Duo, 310/310P: several chips under one NPU id on 310 cards) or
`Chip Phy-ID` (Atlas A3, "Ascend910": two chips per NPU, one two-row block per chip). After the chips
comes a process table (`| NPU Chip | Process id | Process name | Process memory(MB) |` and
`No running processes found in NPU n` lines), which is ignored; so are lines outside the table, such as
the `DrvMngGetConsoleLogLevel failed` warnings npu-smi prints in containers.

Ids. Huawei documents three ids per chip: the logical id (ASCEND_RT_VISIBLE_DEVICES takes logical
ids, CANN environment variable reference), the physical id (the N of /dev/davinciN: "ls /dev/davinci*
gives the physical ids", DCMI reference of dcmi_get_device_logicid_from_phyid) and the NPU id / chip id
pair that `npu-smi info` prints. `npu-smi info -m` maps each (NPU ID, Chip ID) to its "Chip Logic ID"
("-" for the board's Mcu, which is not a compute chip). Huawei's paired samples for one Atlas 800 model
3000 print Device 3..6 in `npu-smi info` and Chip Logic ID 0..3 in `npu-smi info -m`, so the Device (or
Phy-ID) column is the physical id, not the logical one. The adapter therefore runs both commands:
- `ObservedDevice.index` is the Chip Logic ID of the chip's (NPU, Chip) pair;
- `ObservedDevice.node_id` is the Device / Phy-ID column when the table has one and it differs from the
  logical id (the device node is /dev/davinci<node_id>), else None (the node is /dev/davinci<index>).
When `npu-smi info -m` cannot be run or does not list every chip (an old tool), the table alone decides,
applied to the whole table:
1. When the table has a Device or Phy-ID column and every chip has a distinct number there, the index is
   that number (physical = logical outside containers, which is where the agent runs).
2. Otherwise, when every NPU id has exactly one chip, the index is the NPU id.
3. Otherwise the chips are numbered 0, 1, 2... in the order the table lists them (logical chip order).

Memory: HBM-Usage when the table has it and its total is not 0 (910A/910B/A3); else Memory-Usage
(310/310P, and the DDR figure of older 910 drivers). Units are MB as printed. Utilization is AICore(%).
Health words: OK -> OK, Warning -> Warning, Alarm and Critical -> Critical (Alarm is npu-smi's "major
alarm": the chip should take no new work), anything else (UNKNOWN, NA) -> Unknown.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass

import structlog

from kunlun_common.messages import msg
from node_agent.vendors.base import (
    HEALTH_CRITICAL,
    HEALTH_OK,
    HEALTH_UNKNOWN,
    HEALTH_WARNING,
    ObservedDevice,
    ToolFailed,
    VendorAdapter,
    format_command,
    is_unavailable,
    parse_float,
    parse_int,
)
from node_agent.vendors.record import StandIn, Vendor, VendorRuntime

log = structlog.get_logger()

_HEALTH = {"ok": HEALTH_OK, "warning": HEALTH_WARNING, "alarm": HEALTH_CRITICAL, "critical": HEALTH_CRITICAL}
_BUS_ID_RE = re.compile(r"^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]$")
_ROW1_RE = re.compile(r"^(\d+)\s+(\S.*)$")
_PAIR_RE = re.compile(r"([^\s/]+)\s*/\s*([^\s/]+)")


@dataclass
class _Chip:
    npu_id: int
    model: str
    health: str
    power_w: float | None
    temperature_c: float | None
    chip_id: int | None = None
    second_id: int | None = None
    bus_id: str | None = None
    utilization_pct: float | None = None
    memory: tuple[int | None, int | None] | None = None  # (used, total)
    hbm: tuple[int | None, int | None] | None = None


def _cells(line: str) -> list[str] | None:
    text = line.strip()
    if not text.startswith("|"):
        return None
    parts = [part.strip() for part in text.strip("|").split("|")]
    return parts if len(parts) >= 3 else None


def _pair(match: re.Match[str]) -> tuple[int | None, int | None]:
    return parse_int(match.group(1)), parse_int(match.group(2))


def _second_id_column(header_row2: list[str]) -> str | None:
    words = header_row2[0].split()
    return words[1] if len(words) > 1 else None


def _parse_chips(text: str) -> tuple[list[_Chip], bool]:
    """The chips of an `npu-smi info` table and whether it has an HBM-Usage column."""
    chips: list[_Chip] = []
    second_column: str | None = None
    has_hbm = False
    in_table = False
    current: _Chip | None = None
    for line in text.splitlines():
        cells = _cells(line)
        if cells is None:
            continue
        joined = " ".join(cells)
        if "Process id" in joined or "Process name" in joined:
            break  # the process table follows the chips
        if cells[0].startswith("NPU") and "Health" in cells[1]:
            in_table = True
            continue
        if cells[0].startswith("Chip") and "Bus-Id" in cells[1]:
            second_column = _second_id_column(cells)
            has_hbm = "HBM-Usage" in joined
            continue
        if not in_table:
            continue
        row1 = _ROW1_RE.match(cells[0])
        is_bus = bool(_BUS_ID_RE.match(cells[1]))
        is_health = cells[1].lower() in _HEALTH or cells[1].upper() == "UNKNOWN"
        # A row is a chip row when its second cell is a bus id, or (when that cell says NA) when the NPU row
        # before it still waits for its chip row.
        expects_chip = current is not None and current.chip_id is None
        if is_bus or (not is_health and expects_chip):
            if current is None:
                continue
            chip = current if current.chip_id is None else dataclasses.replace(current)
            _fill_chip_row(chip, cells, second_column)
            if chip is not current:
                chips.append(chip)
            current = chip
            continue
        if row1 is None:
            continue
        power_temp = cells[2].split()
        current = _Chip(
            npu_id=int(row1.group(1)),
            model=row1.group(2).strip(),
            health=_HEALTH.get(cells[1].lower(), HEALTH_UNKNOWN),
            power_w=parse_float(power_temp[0]) if power_temp else None,
            temperature_c=parse_float(power_temp[1]) if len(power_temp) > 1 else None,
        )
        chips.append(current)
    return [chip for chip in chips if chip.chip_id is not None], has_hbm


def chip_keys(text: str) -> list[tuple[int, int]]:
    """The (NPU ID, Chip ID) of every chip of an `npu-smi info` table."""
    return [(c.npu_id, c.chip_id if c.chip_id is not None else -1) for c in _parse_chips(text)[0]]


def parse_npu_smi_info(
    text: str, logic_ids: Mapping[tuple[int, int], int] | None = None
) -> list[ObservedDevice]:
    """Parse the output of `npu-smi info`, with the (NPU ID, Chip ID) -> Chip Logic ID map of
    `npu-smi info -m` when there is one (see the module docstring for the rules)."""
    chips, has_hbm = _parse_chips(text)
    logical = _logical_ids(chips, logic_ids or {})
    if logical is None:
        return [_observed(chip, index, has_hbm) for chip, index in zip(chips, _indexes(chips), strict=True)]
    return [
        _observed(chip, index, has_hbm, chip.second_id if chip.second_id not in (None, index) else None)
        for chip, index in zip(chips, logical, strict=True)
    ]


def _logical_ids(chips: list[_Chip], logic_ids: Mapping[tuple[int, int], int]) -> list[int] | None:
    """The Chip Logic ID of every chip, or None when `npu-smi info -m` did not give one for each."""
    found = [logic_ids.get((chip.npu_id, chip.chip_id if chip.chip_id is not None else -1)) for chip in chips]
    if not found or any(f is None for f in found) or len(set(found)) != len(found):
        return None
    return [f for f in found if f is not None]


_MAPPING_HEADER_RE = re.compile(r"NPU\s+ID\s+Chip\s+ID\s+Chip\s+Logic\s+ID", re.IGNORECASE)


def parse_npu_smi_mapping(text: str) -> dict[tuple[int, int], int]:
    """Parse `npu-smi info -m`: (NPU ID, Chip ID) -> Chip Logic ID; rows without a logic id ("-": the
    Mcu) and lines that are not table rows are skipped. Empty when the header is missing."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if _MAPPING_HEADER_RE.search(line)), None)
    if start is None:
        return {}
    out: dict[tuple[int, int], int] = {}
    for line in lines[start + 1 :]:
        words = line.split()
        if len(words) < 3 or not (words[0].isdigit() and words[1].isdigit()):
            continue
        if words[2].isdigit():
            out[(int(words[0]), int(words[1]))] = int(words[2])
    return out


def _fill_chip_row(chip: _Chip, cells: list[str], second_column: str | None) -> None:
    ids = cells[0].split()
    chip.chip_id = parse_int(ids[0]) if ids else None
    if chip.chip_id is None:
        chip.chip_id = -1  # a chip row whose id is unreadable still belongs to its NPU row
    if second_column is not None and len(ids) > 1:
        chip.second_id = parse_int(ids[1])
    chip.bus_id = None if is_unavailable(cells[1]) else cells[1]
    values = cells[2]
    first = values.split()
    chip.utilization_pct = parse_float(first[0]) if first else None
    pairs = [_pair(m) for m in _PAIR_RE.finditer(values)]
    chip.memory = pairs[0] if pairs else None
    chip.hbm = pairs[1] if len(pairs) > 1 else None


def _indexes(chips: list[_Chip]) -> list[int]:
    seconds = [chip.second_id for chip in chips]
    if seconds and all(s is not None for s in seconds) and len(set(seconds)) == len(seconds):
        return [s for s in seconds if s is not None]
    npu_ids = [chip.npu_id for chip in chips]
    if len(set(npu_ids)) == len(npu_ids):
        return npu_ids
    return list(range(len(chips)))


def _observed(chip: _Chip, index: int, has_hbm: bool, node_id: int | None = None) -> ObservedDevice:
    used, total = chip.memory if chip.memory is not None else (None, None)
    if has_hbm and chip.hbm is not None and chip.hbm[1]:
        used, total = chip.hbm
    return ObservedDevice(
        index=index,
        model=chip.model,
        memory_total_mb=total,
        memory_used_mb=used,
        utilization_pct=chip.utilization_pct,
        temperature_c=chip.temperature_c,
        power_w=chip.power_w,
        health=chip.health,
        bus_id=chip.bus_id,
        node_id=node_id,
    )


class AscendAdapter(VendorAdapter):
    device_type = "ascend"
    tool = "npu-smi"

    def command(self) -> list[str]:
        return [self.tool, "info"]

    _logic_ids: dict[tuple[int, int], int] = {}  # the last `npu-smi info -m` (replaced, never mutated)
    _mapped_keys: frozenset[tuple[int, int]] | None = None  # the chips it was run for

    def mapping_command(self) -> list[str]:
        return [self.tool, "info", "-m"]

    def discover(self) -> list[ObservedDevice]:
        self._start()
        command = self.command()
        result = self._run(command)
        if "Health" not in result.stdout:
            raise self._unparsable(
                command, msg("device.ascend.no_table", "no NPU table found"), result.stdout
            )
        keys = frozenset(chip_keys(result.stdout))
        if keys != self._mapped_keys:
            # Logical ids change only when chips come or go (driver reload): -m runs again only then.
            self._mapped_keys = keys
            try:
                self._logic_ids = parse_npu_smi_mapping(self._run(self.mapping_command()).stdout)
            except ToolFailed as exc:  # an old npu-smi without -m: the table alone decides (docstring)
                log.warning(
                    "npu_smi.no_logic_ids", command=format_command(self.mapping_command()), error=str(exc)
                )
                self._logic_ids = {}
        return parse_npu_smi_info(result.stdout, self._logic_ids)


VENDOR = Vendor(
    type_name="ascend",
    aliases=("huawei", "npu"),
    adapter=AscendAdapter,
    runtime=VendorRuntime(
        visible_env="ASCEND_RT_VISIBLE_DEVICES",
        device_node=lambda n: f"/dev/davinci{n}",
        shared_nodes=("/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"),
        # SGLang's Ascend guide: --device npu and the Ascend attention backend.
        sglang_args=("--device", "npu", "--attention-backend", "ascend"),
    ),
    standin=StandIn(module="npu_smi", tools=("npu-smi",)),
)
