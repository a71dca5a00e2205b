"""The vendor registry: one module per accelerator vendor, each exporting one `Vendor` record (`VENDOR`).

`VENDORS` maps the device type to its record; it is built from the shared registry line of
`kunlun_common.names.VENDOR_NAMES`, importing `node_agent.vendors.<type>` for each name there. Every table
that used to list vendors side by side (adapters, runtimes, launch profiles, config enums, stand-ins)
reads this registry instead. Adding a vendor touches its module here, its fixtures, its stand-in and its
line in `VENDOR_NAMES` (see README, "Adding a device vendor").

`adapter_for("ascend")` returns a ready adapter. The same adapters run in simulated mode, where the tools on
PATH are the simulator's stand-ins (`node_agent.plugins.standin`, which nothing here imports).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from kunlun_common.names import DEVICE_TYPES
from node_agent.vendors.base import (
    ObservedDevice,
    ToolError,
    ToolFailed,
    ToolNotFound,
    ToolTimeout,
    VendorAdapter,
    cross_check,
)
from node_agent.vendors.record import StandIn, Vendor, VendorRuntime


def _load() -> dict[str, Vendor]:
    out: dict[str, Vendor] = {}
    for name in DEVICE_TYPES:
        record = getattr(importlib.import_module(f"{__name__}.{name}"), "VENDOR", None)
        if not isinstance(record, Vendor) or record.type_name != name:
            raise ImportError(
                f"node_agent/vendors/{name}.py must export VENDOR = Vendor(type_name={name!r}, ...)"
            )
        if record.adapter.device_type != name:
            raise ImportError(
                f"node_agent/vendors/{name}.py: its adapter says device_type {record.adapter.device_type!r}"
            )
        out[name] = record
    return out


VENDORS: Mapping[str, Vendor] = _load()
ADAPTERS: Mapping[str, type[VendorAdapter]] = {name: v.adapter for name, v in VENDORS.items()}


def vendor(device_type: str) -> Vendor:
    """The record of `device_type`; raises ValueError naming the known types."""
    try:
        return VENDORS[device_type]
    except KeyError:
        known = ", ".join(sorted(VENDORS))
        raise ValueError(f"unknown device type {device_type!r}; expected one of {known}") from None


def adapter_for(device_type: str, env: Mapping[str, str] | None = None) -> VendorAdapter:
    """The adapter for `device_type`; env (default: os.environ) is used for the PATH lookup and the tool."""
    return vendor(device_type).adapter(env=env)


def aliases() -> dict[str, str]:
    """Every alias of every vendor -> its type name."""
    return {alias: v.type_name for v in VENDORS.values() for alias in v.aliases}


__all__ = [
    "ADAPTERS",
    "VENDORS",
    "ObservedDevice",
    "StandIn",
    "ToolError",
    "ToolFailed",
    "ToolNotFound",
    "ToolTimeout",
    "Vendor",
    "VendorAdapter",
    "VendorRuntime",
    "adapter_for",
    "aliases",
    "cross_check",
    "vendor",
]
