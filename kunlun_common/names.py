"""Device names: `<node>/<type>:<index>` everywhere (API, CLI, JSON, logs), and the vendor registry line.

`VENDOR_NAMES` is the one list of accelerator vendors, shared by every process: the control plane
validates device types and workload engines with it, the node agent loads `node_agent/vendors/<type>.py`
for each entry (that module's `VENDOR` record holds everything else about the vendor). Adding a vendor adds
one line here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kunlun_common.messages import Message, msg


@dataclass(frozen=True)
class VendorName:
    """A vendor as every process knows it."""

    type_name: str
    """Device type: lowercase letters, the `<type>` of device names and the module node_agent/vendors/<type>.py."""
    sglang_refusal_message: Message | None = None
    """Why `engine: sglang` cannot run on this vendor (said at submit, and by the scheduler's
    UnsupportedEngine), as a message; None when SGLang can run on it."""

    @property
    def sglang_refusal(self) -> str:
        """`sglang_refusal_message`'s English text; empty when SGLang can run on this vendor."""
        return "" if self.sglang_refusal_message is None else str(self.sglang_refusal_message)


VENDOR_NAMES: tuple[VendorName, ...] = (
    VendorName("ascend"),
    VendorName("cambricon"),
    VendorName("hygon"),
    VendorName("nvidia"),
    VendorName(
        "iluvatar",
        sglang_refusal_message=msg(
            "vendor.iluvatar.no_sglang", "upstream SGLang has no Iluvatar CoreX device"
        ),
    ),
)
DEVICE_TYPES = tuple(v.type_name for v in VENDOR_NAMES)
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


def sglang_refusal(device_type: str) -> str:
    """Why `engine: sglang` cannot run on `device_type` ("" when it can, or when the type is unknown)."""
    return next((v.sglang_refusal for v in VENDOR_NAMES if v.type_name == device_type), "")


def sglang_refusal_message(device_type: str) -> Message | None:
    """`sglang_refusal` as a message (None when SGLang can run on `device_type`, or the type is unknown)."""
    return next((v.sglang_refusal_message for v in VENDOR_NAMES if v.type_name == device_type), None)


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
