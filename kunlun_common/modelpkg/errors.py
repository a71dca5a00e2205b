"""Why a package was refused, with the exit code `kunlun-cli model verify` returns for each kind.

Every error is permanent (a retry reads the same bytes): the package or the trusted keys must change.
"""

from __future__ import annotations

from kunlun_common.errors import PermanentError
from kunlun_common.messages import Message

EXIT_OK = 0
EXIT_USAGE = 1  # the command could not run: file missing, bad flag, unreadable key
EXIT_MALFORMED = 2  # not a package: truncated, not a tar stream, manifest missing or invalid
EXIT_SIGNATURE = 3  # unsigned (when a signature is required), bad signature, or untrusted key
EXIT_CONTENT = 4  # a file differs from the manifest: hash or size, added, or removed


class PackageError(PermanentError):
    """A package cannot be used. `exit_code` is the CLI's exit status for this kind of problem."""

    exit_code = EXIT_MALFORMED


class MalformedPackageError(PackageError):
    """The bytes are not a well-formed .kunlunpkg (truncated, not tar, manifest absent or invalid)."""

    exit_code = EXIT_MALFORMED


class SignatureError(PackageError):
    """The manifest is unsigned (when a signature is required), its signature is wrong, or the key is untrusted."""

    exit_code = EXIT_SIGNATURE


class ContentError(PackageError):
    """A file in the archive differs from the manifest, or one was added or removed. `path` names it."""

    exit_code = EXIT_CONTENT

    def __init__(self, message: str | Message, path: str) -> None:
        super().__init__(message)
        self.path = path


class PackInputError(PackageError):
    """The model folder or a pack option cannot make a package (no weights, wrong format, limits exceeded)."""

    exit_code = EXIT_USAGE
