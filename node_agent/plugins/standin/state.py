"""The simulator's per-node state file, read by the stand-in vendor tools.

The file is JSON: `{"version": 1, "chips": [{...SimChip fields...}, ...]}`. The agent's executor, tests
and chaos runs change it (utilization, memory used, temperature, health, a chip removed) and the stand-in
tools print whatever it says at the moment they run. `write_state` is atomic (temporary file + os.replace)
and `update_chip` holds an fcntl lock on `<path>.lock` around its read-modify-write, so concurrent
updaters do not lose each other's changes and a tool never reads a half-written file.

`SimChip.model` is the model exactly as the vendor tool prints it ("910B3", "MLU370-X8", "K100_AI",
"NVIDIA A100-SXM4-40GB"); `bus_id` empty means "let the stand-in make one up" (deterministic per index).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shlex
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node_agent.vendors import VENDORS

STATE_VERSION = 1
STATE_ENV = "KUNLUN_SIM_STATE"
HEALTH_VALUES = ("OK", "Warning", "Critical")
DEVICE_TYPES = tuple(VENDORS)
TOOLS = tuple(tool for v in VENDORS.values() for tool in v.standin.tools)
REPO_ROOT = Path(__file__).resolve().parents[3]


@dataclass
class SimChip:
    device_type: str
    index: int
    model: str
    memory_total_mb: int
    memory_used_mb: int = 0
    utilization_pct: float = 0.0
    temperature_c: float = 40.0
    power_w: float = 80.0
    health: str = "OK"
    present: bool = True
    bus_id: str = ""


_FIELDS = {f.name: f for f in dataclasses.fields(SimChip)}
_TYPES: dict[str, tuple[type, ...]] = {
    "device_type": (str,),
    "index": (int,),
    "model": (str,),
    "memory_total_mb": (int,),
    "memory_used_mb": (int,),
    "utilization_pct": (int, float),
    "temperature_c": (int, float),
    "power_w": (int, float),
    "health": (str,),
    "present": (bool,),
    "bus_id": (str,),
}


class StateError(ValueError):
    """The state file or a change to it is invalid; the message names the file, the chip and the field."""


def _check_value(where: str, name: str, value: Any) -> None:
    if name not in _FIELDS:
        raise StateError(f"{where}: unknown field {name!r}; fields are {', '.join(_FIELDS)}")
    types = _TYPES[name]
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise StateError(f"{where}: {name} must be {types[0].__name__}, got {value!r}")
    if name == "health" and value not in HEALTH_VALUES:
        raise StateError(f"{where}: health must be one of {', '.join(HEALTH_VALUES)}, got {value!r}")
    if name == "device_type" and value not in DEVICE_TYPES:
        raise StateError(f"{where}: device_type must be one of {', '.join(DEVICE_TYPES)}, got {value!r}")


def _chip_from_json(where: str, raw: Any) -> SimChip:
    if not isinstance(raw, dict):
        raise StateError(f"{where}: a chip must be an object, got {raw!r}")
    for name, value in raw.items():
        _check_value(where, name, value)
    missing = [name for name in ("device_type", "index", "model", "memory_total_mb") if name not in raw]
    if missing:
        raise StateError(f"{where}: missing {', '.join(missing)}")
    chip = SimChip(**raw)
    chip.utilization_pct = float(chip.utilization_pct)
    chip.temperature_c = float(chip.temperature_c)
    chip.power_w = float(chip.power_w)
    return chip


def read_state(path: str | os.PathLike[str]) -> list[SimChip]:
    """The chips of the state file; raises FileNotFoundError, or StateError naming what is wrong."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise StateError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("chips"), list):
        raise StateError(f'{path}: expected {{"version": {STATE_VERSION}, "chips": [...]}}')
    if data.get("version") != STATE_VERSION:
        raise StateError(
            f"{path}: version {data.get('version')!r} is not supported (expected {STATE_VERSION})"
        )
    chips = [_chip_from_json(f"{path}: chips[{i}]", raw) for i, raw in enumerate(data["chips"])]
    seen: set[tuple[str, int]] = set()
    for chip in chips:
        key = (chip.device_type, chip.index)
        if key in seen:
            raise StateError(f"{path}: two chips are {chip.device_type}:{chip.index}")
        seen.add(key)
    return chips


def write_state(path: str | os.PathLike[str], chips: list[SimChip]) -> None:
    """Write the state file atomically (a temporary file in the same directory, then os.replace)."""
    target = Path(path)
    for chip in chips:
        for name, value in dataclasses.asdict(chip).items():
            _check_value(f"{target}: {chip.device_type}:{chip.index}", name, value)
    payload = {"version": STATE_VERSION, "chips": [dataclasses.asdict(chip) for chip in chips]}
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, indent=2)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(f"{path}.lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def update_chip(path: str | os.PathLike[str], device_type: str, index: int, /, **changes: Any) -> None:
    """Change fields of one chip (e.g. utilization_pct=90.0, present=False) under an exclusive lock."""
    target = Path(path)
    for name, value in changes.items():
        if name in ("device_type", "index"):
            raise StateError(f"{target}: {device_type}:{index}: {name} identifies the chip and cannot change")
        _check_value(f"{target}: {device_type}:{index}", name, value)
    with _locked(target):
        chips = read_state(target)
        for position, chip in enumerate(chips):
            if chip.device_type == device_type and chip.index == index:
                chips[position] = dataclasses.replace(chip, **changes)
                break
        else:
            raise StateError(f"{target}: no chip {device_type}:{index}")
        write_state(target, chips)


def shim_script(
    tool: str, python_executable: str | os.PathLike[str], state_path: str | os.PathLike[str]
) -> str:
    state = shlex.quote(str(Path(state_path).resolve()))
    root = shlex.quote(str(REPO_ROOT))
    return (
        "#!/bin/sh\n"
        f"# Kunlun simulated-mode stand-in for {tool} (written by node_agent.plugins.standin.state).\n"
        f"{STATE_ENV}={state}\n"
        f"export {STATE_ENV}\n"
        f'PYTHONPATH={root}"${{PYTHONPATH:+:$PYTHONPATH}}"\n'
        "export PYTHONPATH\n"
        f'exec {shlex.quote(str(python_executable))} -m node_agent.plugins.standin {tool} "$@"\n'
    )


def install_shims(
    bin_dir: str | os.PathLike[str],
    python_executable: str | os.PathLike[str],
    state_path: str | os.PathLike[str],
) -> dict[str, str]:
    """Write an executable stand-in for every vendor tool (`Vendor.standin.tools`) into bin_dir.

    Each runs `python -m node_agent.plugins.standin <tool>` with KUNLUN_SIM_STATE baked in. Returns the
    environment additions: PATH with bin_dir first (then the current PATH) and KUNLUN_SIM_STATE.
    """
    directory = Path(bin_dir).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    for tool in TOOLS:
        shim = directory / tool
        shim.write_text(shim_script(tool, python_executable, state_path), encoding="utf-8")
        shim.chmod(0o755)
    current = os.environ.get("PATH", "")
    return {
        "PATH": f"{directory}{os.pathsep}{current}" if current else str(directory),
        STATE_ENV: str(Path(state_path).resolve()),
    }
