"""The running release's version, as every process reports it (replicas in `cluster status`, agents
in `node describe`, gateways in `gateway list`): the installed kunlun-platform distribution's own,
so a host upgraded to another release folder reports that release without any code change."""

from __future__ import annotations

import importlib.metadata

UNKNOWN = "0+unknown"


def version() -> str:
    """kunlun-platform's installed version; `UNKNOWN` when run from a tree that was never installed."""
    try:
        return importlib.metadata.version("kunlun-platform")
    except importlib.metadata.PackageNotFoundError:
        return UNKNOWN
