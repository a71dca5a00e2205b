"""Errors that say whether a retry can help (in the spirit of kopf).

Every error takes either a plain English string or a `Message` (kunlun_common/messages.py): a stable
id, an English template and its values. `str(error)` is the English text either way; a Message also
lets the replicas send the id to clients, which show the text in their reader's language.
"""

from __future__ import annotations

from kunlun_common.messages import Message


class KunlunError(Exception):
    """Base of every error this project raises on purpose."""

    def __init__(self, message: str | Message = "", *args: object) -> None:
        super().__init__(str(message), *args)
        self.localizable: Message | None = message if isinstance(message, Message) else None
        """The message with its id, when the error was raised with one."""


class TemporaryError(KunlunError):
    """The operation may succeed if retried after `delay` seconds (etcd unreachable, no quorum...)."""

    def __init__(self, message: str | Message, delay: float = 1.0) -> None:
        super().__init__(message)
        self.delay = delay


class PermanentError(KunlunError):
    """Retrying the same operation cannot help; the input or the setup must change."""


class ConfigError(PermanentError):
    """A configuration file or flag is invalid. The message names the file, the field and the fix."""


class InvalidInput(PermanentError):
    """A request field is invalid. The message names the field and the fix (gRPC INVALID_ARGUMENT)."""


class NotFoundError(PermanentError):
    """The named object does not exist. The message says where to look (gRPC NOT_FOUND)."""


class PermissionRefused(PermanentError):
    """The caller's identity may not do this (gRPC PERMISSION_DENIED)."""


class ConcurrentChange(TemporaryError):
    """Someone else changed the record between our read and our write; retry (gRPC ABORTED)."""
