"""Structured logging with structlog: JSON when not on a terminal, key=value on one otherwise."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

_SECRET_KEYS = ("key", "password", "token", "secret", "api_key")


def _redact(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Never log secrets: drop the value of any field whose name says it is one."""
    for k in list(event):
        if any(k == s or k.endswith("_" + s) for s in _SECRET_KEYS) and not k.endswith("_path"):
            event[k] = "<redacted>"
    return event


def log_json(log_format: str | None) -> bool | None:
    """`--log-format`: json -> True, console -> False, unset -> None (JSON unless stderr is a tty)."""
    return {"json": True, "console": False}.get(log_format or "")


def setup_logging(component: str, level: str = "info", json: bool | None = None) -> None:
    """Configure structlog for a process; call once from main()."""
    use_json = (not sys.stderr.isatty()) if json is None else json
    renderer: Any = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _redact,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(component=component)
