"""Entry point: `python -m node_agent.plugins.standin <tool> [args...]` (what the installed shims exec)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

from node_agent.plugins.standin import cnmon, hy_smi, npu_smi, nvidia_smi
from node_agent.plugins.standin.state import STATE_ENV, SimChip, StateError, read_state

ToolMain = Callable[[Sequence[str], "list[SimChip] | None", TextIO, TextIO], int]

TOOLS: dict[str, ToolMain] = {
    "npu-smi": npu_smi.main,
    "cnmon": cnmon.main,
    "hy-smi": hy_smi.main_hy_smi,
    "rocm-smi": hy_smi.main_rocm_smi,
    "nvidia-smi": nvidia_smi.main,
}


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
