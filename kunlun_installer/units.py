"""systemd units: rendering the bundle's templates for a host, and reading them back for `run` mode.

`run` starts a host's services with exactly the command lines of its installed units (where no
systemd runs: containers, CI), so what is tested is what systemd would start.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from kunlun_installer.errors import InstallError

# role -> the unit it installs, the main config file it needs (name under the etc folder)
ROLES: dict[str, tuple[str, str]] = {
    "control-plane": ("kunlun-platform.service", "replica.yaml"),
    "worker": ("kunlun-agent.service", "device-plugin-config.yaml"),
    "gateway": ("kunlun-gateway.service", "gateway.yaml"),
    "etcd": ("kunlun-etcd.service", "etcd.env"),
}


def render(template: str, values: dict[str, str]) -> str:
    out = template
    for key, value in values.items():
        out = out.replace(f"@{key}@", value)
    left = re.findall(r"@[A-Z]+@", out)
    if left:
        raise InstallError(
            "render units", f"unknown placeholders {sorted(set(left))}", "update the installer"
        )
    return out


@dataclass
class ServiceSpec:
    """What `run` needs from a unit's [Service] section."""

    unit: str
    exec_start: list[str]
    env_files: list[Path] = field(default_factory=list)
    user: str = "root"
    restart_s: float = 2.0
    stop_timeout_s: float = 15.0
    kill_mode: str = "control-group"
    working_dir: str = ""


def _parse_env_file(path: Path) -> dict[str, str]:
    env = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key.strip()):
            raise InstallError(
                "read environment", f"{path}:{n}: expected KEY=VALUE, found {raw!r}", "fix the line"
            )
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def parse_unit(path: Path) -> ServiceSpec:
    """Read the [Service] keys `run` honours from an installed unit file."""
    section = ""
    keys: dict[str, list[str]] = {}
    pending = ""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise InstallError(
            "read unit", f"{path}: missing", "restore it: kunlun-installer verify --repair"
        ) from None
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        if section == "Service" and "=" in line:
            k, _, v = line.partition("=")
            keys.setdefault(k.strip(), []).append(v.strip())
    if "ExecStart" not in keys:
        raise InstallError(
            "read unit", f"{path}: no ExecStart in [Service]", "reinstall: kunlun-installer verify --repair"
        )
    spec = ServiceSpec(unit=path.name, exec_start=shlex.split(keys["ExecStart"][-1]))
    spec.env_files = [Path(v.lstrip("-")) for v in keys.get("EnvironmentFile", [])]
    spec.user = keys.get("User", ["root"])[-1]
    spec.restart_s = float(keys.get("RestartSec", ["2"])[-1])
    spec.stop_timeout_s = float(keys.get("TimeoutStopSec", ["15"])[-1])
    spec.kill_mode = keys.get("KillMode", ["control-group"])[-1]
    spec.working_dir = keys.get("WorkingDirectory", [""])[-1]
    return spec


def command_line(spec: ServiceSpec) -> tuple[list[str], dict[str, str]]:
    """The argv and the extra environment, with ${VAR} expanded the way systemd does."""
    env: dict[str, str] = {}
    for f in spec.env_files:
        env.update(_parse_env_file(f))
    argv = []
    for word in spec.exec_start:
        m = re.fullmatch(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", word)
        if m:  # ${VAR} alone: one argument (systemd splits $VAR, keeps ${VAR} whole)
            if m.group(1) not in env:
                raise InstallError(
                    "expand unit",
                    f"{spec.unit}: ${{{m.group(1)}}} is set in no EnvironmentFile",
                    "reinstall the role",
                )
            argv.append(env[m.group(1)])
        else:
            argv.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda x: env.get(x.group(1), ""), word))
    return argv, env
