"""Errors that say whether a retry can help (in the spirit of kopf)."""

from __future__ import annotations


class KunlunError(Exception):
    """Base of every error this project raises on purpose."""


class TemporaryError(KunlunError):
    """The operation may succeed if retried after `delay` seconds (etcd unreachable, no quorum...)."""

    def __init__(self, message: str, delay: float = 1.0) -> None:
        super().__init__(message)
        self.delay = delay


class PermanentError(KunlunError):
    """Retrying the same operation cannot help; the input or the setup must change."""


class ConfigError(PermanentError):
    """A configuration file or flag is invalid. The message names the file, the field and the fix."""
