"""Hygon DCU: parse `hy-smi ... --json` (or `rocm-smi ... --json` from older DTK releases).

Command: `hy-smi --showproductname --showmeminfo vram --showuse --showpower --showtemp --showbus --json`.
When hy-smi is not on PATH but rocm-smi is (DTK before hy-smi existed), rocm-smi is run with the same
flags. The JSON is `{"card0": {...}, "card1": {...}}`; keys differ between releases, so they are matched
case-insensitively and several spellings are accepted:

    index        the N of the "cardN" key
    model        "Card Series" (e.g. "K100_AI", "Z100L")
    memory       "vram Total Memory (MiB)" / "vram Total Used Memory (MiB)"; older releases print
                 "... (B)" in bytes, converted to MB (floor)
    utilization  "HCU use (%)" (DTK 25.04 and later), "DCU use (%)" (earlier), "GPU use (%)"
    temperature  the first present of Sensor junction, core, edge, mem ("Temperature (Sensor X) (C)")
    power        "Average Graphics Package Power (W)" (or "Current Socket Graphics Package Power (W)")
    bus id       "PCI Bus"

Values may be strings or numbers. hy-smi can print warning lines around the JSON; the adapter parses the
outermost `{...}`. Keys that are not "cardN" (and the empty key some releases print) are ignored.

The JSON has no health field. Health is Critical when a card is listed but neither its memory nor its
utilization can be read (N/A: the card enumerates but does not answer), otherwise OK. A Warning state
cannot be expressed by this tool's JSON.
"""

from __future__ import annotations

import json
import re
import shutil
from typing import Any

from kunlun_common.messages import Message, msg
from node_agent.vendors.base import (
    HEALTH_CRITICAL,
    HEALTH_OK,
    ObservedDevice,
    ToolNotFound,
    VendorAdapter,
    is_unavailable,
    mb_from_bytes,
    parse_float,
    parse_int,
)
from node_agent.vendors.record import StandIn, Vendor, VendorRuntime

FLAGS = ["--showproductname", "--showmeminfo", "vram", "--showuse", "--showpower", "--showtemp", "--showbus"]
_CARD_RE = re.compile(r"^card(\d+)$", re.IGNORECASE)
_TEMPERATURE_SENSORS = ("junction", "core", "edge", "mem", "memory")
_USE_KEYS = ("hcu use (%)", "dcu use (%)", "gpu use (%)")
_POWER_KEYS = ("average graphics package power (w)", "current socket graphics package power (w)")


class SmiFormatError(ValueError):
    """The output is not the JSON that hy-smi/rocm-smi print (the message says how)."""

    def __init__(self, message: Message) -> None:
        super().__init__(str(message))
        self.localizable = message


def _extract_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end <= start:
        raise SmiFormatError(msg("device.smi.no_json", "no JSON object in the output"))
    try:
        return json.loads(text[start : end + 1])
    except json.JSONDecodeError as exc:
        raise SmiFormatError(msg("device.tool.not_json", "not JSON: {error}", error=str(exc))) from exc


def _memory(fields: dict[str, Any], which: str) -> int | None:
    mib = fields.get(f"vram total {which}memory (mib)")
    if mib is not None:
        return parse_int(mib)
    raw = fields.get(f"vram total {which}memory (b)")
    return None if raw is None else mb_from_bytes(raw)


def _first(fields: dict[str, Any], keys: tuple[str, ...]) -> float | None:
    for key in keys:
        if key in fields:
            return parse_float(fields[key])
    return None


def parse_smi_json(text: str) -> list[ObservedDevice]:
    """Parse `hy-smi/rocm-smi --json` output; raises SmiFormatError when it is not that format."""
    data = _extract_json(text)
    if not isinstance(data, dict):
        raise SmiFormatError(msg("device.smi.not_object", "the JSON is not an object"))
    devices: list[ObservedDevice] = []
    for key, card in data.items():
        match = _CARD_RE.match(key.strip())
        if match is None or not isinstance(card, dict):
            continue
        fields = {str(k).strip().lower(): v for k, v in card.items()}
        total, used = _memory(fields, ""), _memory(fields, "used ")
        utilization = _first(fields, _USE_KEYS)
        temperature = _first(fields, tuple(f"temperature (sensor {s}) (c)" for s in _TEMPERATURE_SENSORS))
        bus = fields.get("pci bus")
        model = fields.get("card series") or fields.get("card model") or fields.get("device name") or ""
        unreadable = total is None and used is None and utilization is None
        devices.append(
            ObservedDevice(
                index=int(match.group(1)),
                model=str(model).strip(),
                memory_total_mb=total,
                memory_used_mb=used,
                utilization_pct=utilization,
                temperature_c=temperature,
                power_w=_first(fields, _POWER_KEYS),
                health=HEALTH_CRITICAL if unreadable else HEALTH_OK,
                bus_id=None if bus is None or is_unavailable(bus) else str(bus).strip(),
            )
        )
    return sorted(devices, key=lambda d: d.index)


class HygonAdapter(VendorAdapter):
    device_type = "hygon"
    tool = "hy-smi"
    fallback_tool = "rocm-smi"

    def _tool_on_path(self) -> str:
        path = self.env.get("PATH", "")
        if shutil.which(self.tool, path=path) is None and shutil.which(self.fallback_tool, path=path):
            return self.fallback_tool
        return self.tool

    def command(self) -> list[str]:
        return [self._tool_on_path(), *FLAGS, "--json"]

    def discover(self) -> list[ObservedDevice]:
        self._start()
        command = self.command()
        path = self.env.get("PATH", "")
        if shutil.which(command[0], path=path) is None:
            raise ToolNotFound(f"{self.tool} (or {self.fallback_tool})", command, path)
        result = self._run(command)
        try:
            return parse_smi_json(result.stdout)
        except SmiFormatError as exc:
            raise self._unparsable(command, exc.localizable, result.stdout) from exc


VENDOR = Vendor(
    type_name="hygon",
    aliases=("dcu",),
    adapter=HygonAdapter,
    runtime=VendorRuntime(
        visible_env="HIP_VISIBLE_DEVICES",
        # DCUs are driven through ROCm's KFD (/dev/kfd, shared) and one DRM render node per card, numbered
        # from 128 in probe order (off by the number of other render nodes that enumerate first).
        device_node=lambda n: f"/dev/dri/renderD{128 + n}",
        shared_nodes=("/dev/kfd",),
        # No --device: SGLang's AMD GPU guide (docs.sglang.io, hardware-platforms/amd_gpu) launches ROCm
        # builds without it and SGLang detects the device itself (ROCm/DTK PyTorch reports HIP devices as
        # torch's "cuda"); DTK builds of SGLang follow the ROCm path.
        sglang_args=(),
        cache_env=(("MIOPEN_USER_DB_PATH", "miopen"), ("MIOPEN_CUSTOM_CACHE_DIR", "miopen")),
    ),
    standin=StandIn(module="hy_smi", tools=("hy-smi", "rocm-smi")),
)
