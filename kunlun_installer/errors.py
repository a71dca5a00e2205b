"""The installer's one error: which step failed, what happened, and what to do."""

from __future__ import annotations


class InstallError(Exception):
    """A step could not proceed. Nothing after it ran; running the same command again is safe."""

    def __init__(self, step: str, what: str, fix: str) -> None:
        super().__init__(f"{step}: {what}")
        self.step = step
        self.what = what
        self.fix = fix

    def __str__(self) -> str:
        return f"step '{self.step}' failed: {self.what}; {self.fix}"
