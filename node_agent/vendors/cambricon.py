"""Cambricon MLU: parse `cnmon info -j`.

In JSON mode cnmon does not print the JSON: it writes `cnmon_info.json` into its current directory (public
integrations run it and then read that file). The adapter therefore runs cnmon in a fresh temporary
directory and reads the file from there; `last_output()` returns the file's text.

The file holds `{"CnmonInfo": [card, ...]}`; per card the adapter reads:
    CardNum                     -> index (the card number cnmon prints, the N of MLU_VISIBLE_DEVICES)
    ProductName                 -> model ("MLU370-X8")
    PhysicalMemUsage.Total/Used -> memory, MiB (a string with a unit, "24576 MiB", is accepted too)
    Utilization.MLUAverage      -> utilization %
    Temperature.Chip            -> temperature °C (Temperature.Board when Chip is missing)
    Power.Usage                 -> power W
    PCI.DomainID/Bus/Device/Function -> bus id "DDDD:BB:DD.F"
Values may be numbers or strings; "N/A" and friends become None.

cnmon has no health column, so health is derived from what the file does say:
    Critical - the card is listed but neither its memory nor its utilization can be read (a card that
               enumerates but does not answer; cnmon prints N/A for it),
    Warning  - the PCIe link runs below its capability (PCI.CurrentSpeed/CurrentWidth differ from
               MaxSpeed/MaxWidth: a degraded link, e.g. after a riser or slot fault),
    OK       - otherwise.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from kunlun_common.messages import Message, msg
from node_agent.vendors.base import (
    HEALTH_CRITICAL,
    HEALTH_OK,
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

JSON_FILE = "cnmon_info.json"


class CnmonFormatError(ValueError):
    """The JSON is not what `cnmon info -j` writes (the message says how)."""

    def __init__(self, message: Message) -> None:
        super().__init__(str(message))
        self.localizable = message


def _section(card: dict[str, Any], name: str) -> dict[str, Any]:
    value = card.get(name)
    return value if isinstance(value, dict) else {}


def _bus_id(pci: dict[str, Any]) -> str | None:
    parts = [pci.get(key) for key in ("DomainID", "Bus", "Device", "Function")]
    if any(part is None or is_unavailable(part) for part in parts):
        return None
    domain, bus, device, function = (str(part).strip() for part in parts)
    return f"{domain}:{bus}:{device}.{function}"


def _health(card: dict[str, Any], memory_used: int | None, utilization: float | None) -> str:
    memory = _section(card, "PhysicalMemUsage")
    if parse_int(memory.get("Total")) is None and memory_used is None and utilization is None:
        return HEALTH_CRITICAL
    pci = _section(card, "PCI")
    for current, maximum in (("CurrentSpeed", "MaxSpeed"), ("CurrentWidth", "MaxWidth")):
        now, cap = pci.get(current), pci.get(maximum)
        if now is None or cap is None or is_unavailable(now) or is_unavailable(cap):
            continue
        if str(now).replace(" ", "").lower() != str(cap).replace(" ", "").lower():
            return HEALTH_WARNING
    return HEALTH_OK


def parse_cnmon_json(text: str) -> list[ObservedDevice]:
    """Parse the content of cnmon_info.json; raises CnmonFormatError when it is not that format."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CnmonFormatError(msg("device.tool.not_json", "not JSON: {error}", error=str(exc))) from exc
    if not isinstance(data, dict) or not isinstance(data.get("CnmonInfo"), list):
        raise CnmonFormatError(msg("device.cnmon.no_list", 'no "CnmonInfo" list'))
    devices: list[ObservedDevice] = []
    for position, card in enumerate(data["CnmonInfo"]):
        if not isinstance(card, dict):
            raise CnmonFormatError(
                msg("device.cnmon.not_object", "CnmonInfo[{position}] is not an object", position=position)
            )
        index = parse_int(card.get("CardNum"))
        if index is None:
            raise CnmonFormatError(
                msg("device.cnmon.no_card", "CnmonInfo[{position}] has no CardNum", position=position)
            )
        memory = _section(card, "PhysicalMemUsage")
        temperature = _section(card, "Temperature")
        used = parse_int(memory.get("Used"))
        utilization = parse_float(_section(card, "Utilization").get("MLUAverage"))
        chip_temp = parse_float(temperature.get("Chip"))
        devices.append(
            ObservedDevice(
                index=index,
                model=str(card.get("ProductName", "")).strip(),
                memory_total_mb=parse_int(memory.get("Total")),
                memory_used_mb=used,
                utilization_pct=utilization,
                temperature_c=chip_temp if chip_temp is not None else parse_float(temperature.get("Board")),
                power_w=parse_float(_section(card, "Power").get("Usage")),
                health=_health(card, used, utilization),
                bus_id=_bus_id(_section(card, "PCI")),
            )
        )
    return devices


class CambriconAdapter(VendorAdapter):
    device_type = "cambricon"
    tool = "cnmon"

    def command(self) -> list[str]:
        return [self.tool, "info", "-j"]

    def discover(self) -> list[ObservedDevice]:
        self._start()
        command = self.command()
        with tempfile.TemporaryDirectory(prefix="kunlun-cnmon-") as workdir:
            result = self._run(command, cwd=workdir, record=False)
            path = Path(workdir) / JSON_FILE
            try:
                text = path.read_text(encoding="utf-8", errors="replace")
            except FileNotFoundError:
                raise ToolFailed(
                    msg(
                        "device.cnmon.no_file",
                        "`{command}` exited 0 but wrote no {file} in its working directory; this cnmon version "
                        "may not support JSON mode (-j): upgrade the Cambricon driver/CNToolkit",
                        command=format_command(command),
                        file=JSON_FILE,
                    ),
                    tool=self.tool,
                    command=command,
                    returncode=result.returncode,
                    stdout=result.stdout,
                    stderr=result.stderr,
                ) from None
        self._record(command, text)
        try:
            return parse_cnmon_json(text)
        except CnmonFormatError as exc:
            why = msg(
                "device.tool.file_problem", "{file}: {problem}", file=JSON_FILE, problem=exc.localizable
            )
            raise self._unparsable(command, why, text) from exc


VENDOR = Vendor(
    type_name="cambricon",
    aliases=("mlu",),
    adapter=CambriconAdapter,
    runtime=VendorRuntime(
        visible_env="MLU_VISIBLE_DEVICES",
        device_node=lambda n: f"/dev/cambricon_dev{n}",
        shared_nodes=("/dev/cambricon_ctl",),
        # Upstream SGLang has no MLU device; Cambricon's SGLang build selects the MLU itself.
        sglang_args=(),
    ),
    standin=StandIn(module="cnmon", tools=("cnmon",)),
)
