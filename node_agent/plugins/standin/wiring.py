"""Simulated-mode wiring: what `node_agent.simulation.simulated_mode` loads on a simulated node.

`wire()` seeds the stand-in tools' state file from the declaration (once), installs their shims on a
private PATH and returns the hook the executor calls with each chip's simulated usage (written with
`update_chip`, under the state file's lock).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import structlog

from node_agent.plugins.config import NodeConfig
from node_agent.plugins.standin.state import SimChip, StateError, install_shims, update_chip, write_state
from node_agent.simulation import ChipUsage, SimulatedMode
from node_agent.vendors import VENDORS

log = structlog.get_logger("simulator")


def state_path_for(config: NodeConfig, state_dir: Path) -> Path:
    return Path(config.simulator_state) if config.simulator_state else state_dir / "sim-state.json"


def seed_state(config: NodeConfig, state: Path) -> None:
    """Write the state file from the declaration unless it exists already."""
    if state.exists():
        return
    chips = [
        SimChip(
            device_type=d.device_type,
            index=d.device_id,
            model=d.model,
            memory_total_mb=d.hbm_memory_mb or d.total_memory_mb,
            bus_id=f"0000:{0x10 + i:02x}:00.0",
        )
        for i, d in enumerate(config.devices)
        if d.device_type in VENDORS
    ]
    state.parent.mkdir(parents=True, exist_ok=True)
    write_state(state, chips)


def chip_usage_writer(state: Path) -> ChipUsage:
    """The executor's hook: write one chip's memory used and utilization into the state file."""

    def write(device_type: str, index: int, memory_used_mb: int, utilization_pct: float) -> None:
        try:
            update_chip(
                state, device_type, index, memory_used_mb=memory_used_mb, utilization_pct=utilization_pct
            )
        except (StateError, OSError) as e:
            log.debug("simulated chip not updated", chip=f"{device_type}:{index}", error=str(e))

    return write


def wire(config: NodeConfig, state_dir: Path) -> SimulatedMode:
    """Seed the state, install the shims, and hand back the environment and the usage hook."""
    state = state_path_for(config, state_dir)
    seed_state(config, state)
    env = dict(os.environ)
    env.update(install_shims(state_dir / "sim-bin", sys.executable, state))
    return SimulatedMode(env=env, chip_usage=chip_usage_writer(state.resolve()), state_path=state.resolve())
