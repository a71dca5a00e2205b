"""Entry point: `python -m node_agent.plugins.standin <tool> [args...]` (what the installed shims exec)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

from node_agent.plugins.standin.state import STATE_ENV, SimChip, StateError, read_state
from node_agent.vendors import VENDORS

ToolMain = Callable[[Sequence[str], "list[SimChip] | None", TextIO, TextIO], int]


def _tools() -> dict[str, ToolMain]:
    """Every vendor's stand-in tools: `TOOLS` of the module its record names (`Vendor.standin`)."""
    out: dict[str, ToolMain] = {}
    for v in VENDORS.values():
        module = importlib.import_module(f"node_agent.plugins.standin.{v.standin.module}")
        table: dict[str, ToolMain] = module.TOOLS
        for tool in v.standin.tools:
            out[tool] = table[tool]
    return out


TOOLS = _tools()


def load_chips(err: TextIO) -> list[SimChip] | None:
    """The chips of $KUNLUN_SIM_STATE, or None (with a note on stderr) when there is no usable state: the
    tools then behave as on a machine whose driver is not loaded."""
    path = os.environ.get(STATE_ENV)
    if not path:
        err.write(f"kunlun stand-in: {STATE_ENV} is not set; it must name the simulator state file\n")
        return None
    try:
        return read_state(path)
    except (OSError, StateError) as exc:
        err.write(f"kunlun stand-in: cannot read {STATE_ENV}={path}: {exc}\n")
        return None


def run(argv: Sequence[str], out: TextIO, err: TextIO) -> int:
    if not argv or argv[0] not in TOOLS:
        err.write(f"usage: python -m node_agent.plugins.standin {{{','.join(TOOLS)}}} [args...]\n")
        return 2
    return TOOLS[argv[0]](list(argv[1:]), load_chips(err), out, err)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:], sys.stdout, sys.stderr))
