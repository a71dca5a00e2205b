"""Device profile snapshots for a package, taken from a node's device-plugin-config.yaml.

The packer runs where the node agent's strict loader is not importable (the CLI), so this reads only
what a snapshot needs from the YAML and refuses anything it cannot place. A snapshot records the
declared model, memory, dtypes and compute of the target device, plus the declaration's node name and
SHA-256, so `model inspect` shows what the package was built and checked for.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import yaml

from kunlun_common.errors import ConfigError
from kunlun_common.messages import msg
from kunlun_common.names import DEVICE_TYPES

TARGET_RE = re.compile(r"^(?P<type>[a-z]+)(:(?P<index>\d+))?$")
PROFILE_FIELDS = (
    "model",
    "hbm_memory_mb",
    "total_memory_mb",
    "supported_dtypes",
    "fp16_compute_power_tflops",
    "bf16_compute_power_tflops",
    "int8_compute_power_tflops",
)


def parse_target(text: str) -> tuple[str, int | None]:
    """`ascend:0` or `ascend` (any device of the type)."""
    m = TARGET_RE.match(text)
    if not m or m["type"] not in DEVICE_TYPES:
        raise ConfigError(
            msg(
                "package.profiles.target_device_expected_type",
                "--target-device {text!r}: expected TYPE[:INDEX] with TYPE one of {items}, e.g. ascend:0",
                text=text,
                items=", ".join(DEVICE_TYPES),
            )
        )
    return m["type"], int(m["index"]) if m["index"] is not None else None


def snapshot(config_path: Path, device_type: str, index: int | None) -> dict[str, Any]:
    """The declared profile of the target device in the file; ConfigError naming the file when absent."""
    try:
        raw = config_path.read_bytes()
        doc = yaml.safe_load(raw)
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(
            msg(
                "package.profiles.cannot_read_device_declaration",
                "{config_path}: cannot read the device declaration ({e})",
                config_path=config_path,
                e=e,
            )
        ) from None
    devices = doc.get("devices") if isinstance(doc, dict) else None
    node = (
        doc.get("node", {}).get("name")
        if isinstance(doc, dict) and isinstance(doc.get("node"), dict)
        else None
    )
    for d in devices if isinstance(devices, list) else []:
        if not isinstance(d, dict) or d.get("device_type") != device_type:
            continue
        ids = d.get("device_ids", [d.get("device_id")])
        if index is not None and index not in (ids if isinstance(ids, list) else []):
            continue
        prof: dict[str, Any] = {"device_type": device_type, "device_id": index, "node": node}
        for f in PROFILE_FIELDS:
            if f in d:
                v = d[f]
                prof[f] = list(v) if isinstance(v, list) else v
        prof["declaration_sha256"] = hashlib.sha256(raw).hexdigest()
        return prof
    where = f"{device_type}:{index}" if index is not None else device_type
    raise ConfigError(
        msg(
            "package.profiles.declares_no_device_check",
            "{config_path}: declares no device {where}; check --target-device or --device-config",
            config_path=config_path,
            where=where,
        )
    )
