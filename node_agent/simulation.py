"""Simulated mode, injected: the agent asks for it by name and never imports the simulator.

On a node whose config says `simulated: true`, `simulated_mode()` loads the simulator's wiring
(`node_agent.plugins.standin.wiring`, named here as a string so that production code has no import of
the simulator) and gets back a `SimulatedMode`: the environment whose PATH holds the stand-in vendor
tools, and the hook the executor calls with the chips' simulated usage. On real hardware none of this
is loaded.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from node_agent.plugins.config import NodeConfig

ChipUsage = Callable[[str, int, int, float], None]
"""(device_type, index, memory_used_mb, utilization_pct) -> None: record a chip's simulated usage."""
WIRING_MODULE = "node_agent.plugins.standin.wiring"


@dataclass(frozen=True)
class SimulatedMode:
    """What the simulator hands the agent."""

    env: dict[str, str]
    """Environment of the vendor tools: the stand-ins' shims first on PATH, the state file named."""
    chip_usage: ChipUsage
    """Called by the executor with what its engines use of each chip; never raises."""
    state_path: Path
    """The simulator's state file (shown by kunlun-device-probe)."""


def simulated_mode(config: NodeConfig, state_dir: Path) -> SimulatedMode:
    """Load the simulator's wiring and set it up for `config` under `state_dir`."""
    wiring = importlib.import_module(WIRING_MODULE)
    mode = wiring.wire(config, state_dir)
    assert isinstance(mode, SimulatedMode)
    return mode


def tool_env(config: NodeConfig, state_dir: Path) -> dict[str, str]:
    """The environment vendor tools run in: the simulated one on simulated nodes, else this process's."""
    return simulated_mode(config, state_dir).env if config.simulated else dict(os.environ)
