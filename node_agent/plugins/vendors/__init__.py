"""Vendor tool adapters: discover devices by running each vendor's own tool and parsing what it prints.

`adapter_for("ascend")` returns the adapter for a device type. The same adapters run in simulated mode,
where the tools on PATH are the stand-ins of `node_agent.plugins.standin` (see `state.install_shims`).
"""

from __future__ import annotations

from collections.abc import Mapping

from node_agent.plugins.vendors.ascend import AscendAdapter
from node_agent.plugins.vendors.base import (
    ObservedDevice,
    ToolError,
    ToolFailed,
    ToolNotFound,
    ToolTimeout,
    VendorAdapter,
    cross_check,
)
from node_agent.plugins.vendors.cambricon import CambriconAdapter
from node_agent.plugins.vendors.hygon import HygonAdapter
from node_agent.plugins.vendors.nvidia import NvidiaAdapter

ADAPTERS: dict[str, type[VendorAdapter]] = {
    "ascend": AscendAdapter,
    "cambricon": CambriconAdapter,
    "hygon": HygonAdapter,
    "nvidia": NvidiaAdapter,
}


def adapter_for(device_type: str, env: Mapping[str, str] | None = None) -> VendorAdapter:
    """The adapter for `device_type`; env (default: os.environ) is used for the PATH lookup and the tool."""
    try:
        cls = ADAPTERS[device_type]
    except KeyError:
        known = ", ".join(sorted(ADAPTERS))
        raise ValueError(f"unknown device type {device_type!r}; expected one of {known}") from None
    return cls(env=env)


__all__ = [
    "ADAPTERS",
    "ObservedDevice",
    "ToolError",
    "ToolFailed",
    "ToolNotFound",
    "ToolTimeout",
    "VendorAdapter",
    "adapter_for",
    "cross_check",
]
