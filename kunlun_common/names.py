"""Device names: `<node>/<type>:<index>` everywhere (API, CLI, JSON, logs)."""

from __future__ import annotations

import re
from dataclasses import dataclass

DEVICE_TYPES = ("ascend", "cambricon", "hygon", "nvidia")
# the company behind each device type (the `vendor` label of device metrics)
VENDORS = {"ascend": "huawei", "cambricon": "cambricon", "hygon": "hygon", "nvidia": "nvidia"}
NODE_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_DEVICE_RE = re.compile(r"^(?P<node>[a-z0-9][a-z0-9-]*)/(?P<type>[a-z]+):(?P<index>\d+)$")


@dataclass(frozen=True, order=True)
class DeviceName:
    node: str
    device_type: str
    index: int

    def __str__(self) -> str:
        return f"{self.node}/{self.device_type}:{self.index}"


def device_name(node: str, device_type: str, index: int) -> str:
    """Format the canonical device name."""
    return f"{node}/{device_type}:{index}"


def parse_device_name(text: str) -> DeviceName:
    """Parse `<node>/<type>:<index>`; raise ValueError naming the expected form."""
    m = _DEVICE_RE.match(text)
    if not m:
        raise ValueError(
            f"invalid device name {text!r}: expected <node>/<type>:<index>, e.g. node-a/ascend:0"
        )
    return DeviceName(m["node"], m["type"], int(m["index"]))


def valid_node_name(name: str) -> bool:
    """Node names are DNS labels: lowercase letters, digits and '-', at most 63 characters."""
    return bool(NODE_NAME_RE.match(name))
