"""The installer's one error: which step failed, what happened, and what to do."""

from __future__ import annotations

from kunlun_common.i18n import localize
from kunlun_common.messages import Message, msg


class InstallError(Exception):
    """A step could not proceed. Nothing after it ran; running the same command again is safe.

    The step, what happened and the fix are each a text or a message (`kunlun_common.messages`):
    str() of the error is English; `shown()` is the reader's language (kunlun-installer prints that),
    each message translated on its own."""

    def __init__(self, step: str | Message, what: str | Message, fix: str | Message) -> None:
        super().__init__(f"{step}: {what}")
        self.step = str(step)
        self.what = str(what)
        self.fix = str(fix)
        self.message = msg(
            "installer.failed", "step '{step}' failed: {what}; {fix}", step=step, what=what, fix=fix
        )
        """The whole error as one message."""

    def __str__(self) -> str:
        return str(self.message)

    def shown(self) -> str:
        """The error in the reader's language."""
        return localize(self.message)
