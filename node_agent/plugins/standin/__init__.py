"""Stand-in vendor tools for simulated mode: `python -m node_agent.plugins.standin <tool> [args...]`.

Each tool (npu-smi, cnmon, hy-smi, rocm-smi, nvidia-smi) prints its vendor's format from the per-node state
file named by KUNLUN_SIM_STATE (see `state`), and refuses what the real tool refuses. The node agent's
vendor adapters run against them unchanged. Numbers are printed the way the real tool prints them, so
values round-trip only to the tool's precision (e.g. nvidia-smi prints utilization as an integer).
"""

from __future__ import annotations

from node_agent.plugins.standin.state import SimChip


def present_chips(chips: list[SimChip], device_type: str) -> list[SimChip]:
    """The present chips of one device type, by index."""
    return sorted((c for c in chips if c.device_type == device_type and c.present), key=lambda c: c.index)


def bus_number(index: int) -> str:
    """A made-up, stable PCI bus number for a chip without a configured bus id."""
    return f"{(0x18 + 4 * index) % 0x100:02X}"  # distinct for the first 64 indexes
