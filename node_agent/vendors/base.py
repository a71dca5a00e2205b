"""Shared types of the vendor tool adapters and the one way they run a tool.

Every accelerator vendor ships a command-line tool that lists its devices (`npu-smi`, `cnmon`, `hy-smi`,
`nvidia-smi`). An adapter runs that tool, parses what it prints and returns `ObservedDevice`s. The node
agent runs the same adapters in simulated mode: there the tool on PATH is a stand-in
(`node_agent.plugins.standin`) that prints the vendor's format, so no adapter knows whether it is simulated.

`run_tool` is the only place that starts a vendor tool. It looks the tool up on the PATH of the adapter's
environment, never waits longer than the timeout (the tool's whole process group is killed then, so a tool
that forked a child cannot keep the pipes open), and turns every failure into a `ToolError` whose message
names the tool, the command line and what to do.
"""

from __future__ import annotations

import abc
import os
import re
import shlex
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import structlog

from kunlun_common.errors import TemporaryError
from kunlun_common.messages import Message, msg

log = structlog.get_logger()

HEALTH_OK = "OK"
HEALTH_WARNING = "Warning"
HEALTH_CRITICAL = "Critical"
HEALTH_UNKNOWN = "Unknown"
HEALTH_VALUES = (HEALTH_OK, HEALTH_WARNING, HEALTH_CRITICAL, HEALTH_UNKNOWN)

DEFAULT_TIMEOUT_S = 10.0
MEMORY_TOLERANCE = 0.05  # cross_check: declared and observed memory may differ by this fraction

# Words that vendors put in front of the model name and that a declaration may leave out.
_VENDOR_PREFIXES = ("huawei", "ascend", "cambricon", "hygon", "nvidia", "tesla")
_STDERR_EXCERPT = 2000


@dataclass(frozen=True)
class ObservedDevice:
    """One device as the vendor tool reports it, normalised to common units.

    `index` is the vendor's device index (npu logical id / card id / gpu index; see each adapter for its
    rule). Memory is in MB: the MiB that tools print count as MB here, bytes are converted (floor). Any
    value the tool prints as unavailable (`NA`, `N/A`, `[N/A]`, `-`...) is None. `health` is one of
    "OK", "Warning", "Critical", "Unknown".
    """

    index: int
    model: str
    memory_total_mb: int | None
    memory_used_mb: int | None
    utilization_pct: float | None
    temperature_c: float | None
    power_w: float | None
    health: str
    bus_id: str | None = None
    node_id: int | None = None
    """The id the device's node is named by when it differs from `index` (Ascend: the physical id of
    /dev/davinciN, while `index` is the logical id of ASCEND_RT_VISIBLE_DEVICES); None: the index."""


class ToolError(TemporaryError):
    """A vendor tool could not be run or did not give a usable answer."""

    def __init__(self, message: Message, *, tool: str, command: Sequence[str]) -> None:
        super().__init__(message)
        self.tool = tool
        self.command = list(command)


class ToolNotFound(ToolError):
    """The tool is not on the PATH the adapter searched."""

    def __init__(self, tool: str, command: Sequence[str], path: str) -> None:
        message = msg(
            "device.tool.not_found",
            "{tool} not found on PATH ({path}) while running `{command}`; install the vendor driver and "
            "toolkit that provide {tool}, or add its directory to PATH (in simulated mode, install the "
            "stand-in shims with node_agent.plugins.standin.state.install_shims)",
            tool=tool,
            path=path or msg("device.tool.empty_path", "<empty>"),
            command=format_command(command),
        )
        super().__init__(message, tool=tool, command=command)
        self.path = path


class ToolFailed(ToolError):
    """The tool ran but exited with an error, timed out, or printed something that cannot be parsed."""

    def __init__(
        self,
        message: Message,
        *,
        tool: str,
        command: Sequence[str],
        returncode: int | None = None,
        stdout: str = "",
        stderr: str = "",
    ) -> None:
        super().__init__(message, tool=tool, command=command)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr


class ToolTimeout(ToolFailed):
    """The tool did not finish within the timeout and was killed."""


@dataclass(frozen=True)
class ToolResult:
    command: list[str]
    returncode: int
    stdout: str
    stderr: str


def format_command(command: Sequence[str]) -> str:
    return " ".join(shlex.quote(part) for part in command)


def run_tool(
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    cwd: str | Path | None = None,
    ok_returncodes: Sequence[int] = (0,),
) -> ToolResult:
    """Run `command` (its first word looked up on env's PATH) and return what it printed.

    Raises ToolNotFound when the tool is not on PATH, ToolTimeout after `timeout_s` (the process group is
    killed), ToolFailed when it cannot be started or exits with a code outside `ok_returncodes`.
    """
    tool = command[0]
    path = env.get("PATH", "")
    executable = shutil.which(tool, path=path)
    if executable is None:
        raise ToolNotFound(tool, command, path)
    argv = [executable, *command[1:]]
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,  # its own process group, so that a timeout can kill its children too
        )
    except OSError as exc:
        raise ToolFailed(
            msg(
                "device.tool.not_started",
                "`{command}` could not be started ({executable}: {error}); check that {tool} is an "
                "executable for this machine and that the agent may run it",
                command=format_command(command),
                executable=executable,
                error=str(exc),
                tool=tool,
            ),
            tool=tool,
            command=command,
        ) from exc
    try:
        out_bytes, err_bytes = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out_bytes, err_bytes = proc.communicate()
        log.warning("vendor_tool.timeout", tool=tool, command=format_command(command), timeout_s=timeout_s)
        raise ToolTimeout(
            msg(
                "device.tool.timeout",
                "`{command}` did not finish within {timeout_s:g} s and was killed; the driver may be hung "
                "(check dmesg and the {tool} daemon), or raise the adapter timeout",
                command=format_command(command),
                timeout_s=timeout_s,
                tool=tool,
            ),
            tool=tool,
            command=command,
            stdout=_decode(out_bytes),
            stderr=_decode(err_bytes),
        ) from None
    stdout, stderr = _decode(out_bytes), _decode(err_bytes)
    if proc.returncode not in ok_returncodes:
        detail = stderr.strip() or stdout.strip()
        raise ToolFailed(
            msg(
                "device.tool.exit_code",
                "`{command}` exited with code {code}: {detail}; check the {tool} installation and the driver "
                "(run the command by hand to see the full output)",
                command=format_command(command),
                code=proc.returncode,
                detail=detail[:_STDERR_EXCERPT] if detail else msg("device.tool.no_output", "no output"),
                tool=tool,
            ),
            tool=tool,
            command=command,
            returncode=proc.returncode,
            stdout=stdout,
            stderr=stderr,
        )
    return ToolResult(command=list(command), returncode=proc.returncode, stdout=stdout, stderr=stderr)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


class VendorAdapter(abc.ABC):
    """Discovers one vendor's devices by running its tool. Blocking: callers run it in a thread."""

    device_type: ClassVar[str]
    tool: ClassVar[str]

    def __init__(self, env: Mapping[str, str] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.env: dict[str, str] = dict(os.environ if env is None else env)
        self.timeout_s = timeout_s
        self._outputs: list[tuple[list[str], str]] = []

    @abc.abstractmethod
    def discover(self) -> list[ObservedDevice]:
        """Run the tool(s) and parse their output; raises ToolError."""

    @abc.abstractmethod
    def command(self) -> list[str]:
        """The main command line (for `kunlun-device-probe` to print)."""

    def last_output(self) -> str:
        """Raw output of the last discover(): the main command's stdout, then `$ <command>` and the
        output of each further command it ran."""
        if not self._outputs:
            return ""
        parts = [self._outputs[0][1]]
        for command, text in self._outputs[1:]:
            parts.append(f"$ {format_command(command)}\n{text}")
        return "\n".join(parts)

    def _start(self) -> None:
        self._outputs = []

    def _record(self, command: Sequence[str], text: str) -> None:
        self._outputs.append((list(command), text))

    def _run(
        self,
        command: Sequence[str],
        *,
        cwd: str | Path | None = None,
        ok_returncodes: Sequence[int] = (0,),
        record: bool = True,
    ) -> ToolResult:
        result = run_tool(
            command, env=self.env, timeout_s=self.timeout_s, cwd=cwd, ok_returncodes=ok_returncodes
        )
        if record:
            self._record(command, result.stdout)
        return result

    def _unparsable(self, command: Sequence[str], why: Message, stdout: str) -> ToolFailed:
        return ToolFailed(
            msg(
                "device.tool.unparsable",
                "`{command}` printed output that cannot be parsed ({why}); this tool version may print a "
                "format the {device_type} adapter does not know: run it by hand and report the output",
                command=format_command(command),
                why=why,
                device_type=self.device_type,
            ),
            tool=command[0],
            command=command,
            returncode=0,
            stdout=stdout,
        )


# ---------------------------------------------------------------------------------------------- values

_UNAVAILABLE = {"", "na", "n/a", "-", "--", "none", "unknown", "not supported", "not available"}
_NUMBER_RE = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)")


def is_unavailable(text: object) -> bool:
    """True for the spellings tools use for a missing value: NA, N/A, [N/A], -, [Not Supported]..."""
    if text is None:
        return True
    if isinstance(text, int | float):
        return False
    value = str(text).strip()
    if value.startswith("[") and value.endswith("]"):
        return True  # nvidia-smi: [N/A], [Not Supported], [Unknown Error], [GPU requires reset]
    return value.lower() in _UNAVAILABLE


def parse_float(text: object) -> float | None:
    """The leading number of `text` ("52.12 W", "45", 3.5), or None when unavailable or not a number."""
    if isinstance(text, bool):
        return None
    if isinstance(text, int | float):
        return float(text)
    if is_unavailable(text):
        return None
    m = _NUMBER_RE.match(str(text).strip())
    return float(m.group(0)) if m else None


def parse_int(text: object) -> int | None:
    value = parse_float(text)
    return None if value is None else int(value)


def mb_from_bytes(value: object) -> int | None:
    number = parse_float(value)
    return None if number is None else int(number) // (1024 * 1024)


# ---------------------------------------------------------------------------------------------- checks


def normalise_model(name: str) -> str:
    """Lower-case alphanumerics of `name` without a leading vendor word ("Ascend910B3" -> "910b3")."""
    text = re.sub(r"[^a-z0-9]", "", name.lower())
    stripped = True
    while stripped:
        stripped = False
        for prefix in _VENDOR_PREFIXES:
            if text.startswith(prefix) and len(text) > len(prefix):
                text = text[len(prefix) :]
                stripped = True
    return text


def models_match(declared: str, observed: str) -> bool:
    """The model rule of `cross_check`.

    Both names are normalised (`normalise_model`: case, punctuation and a leading vendor word such as
    "Ascend"/"NVIDIA"/"Cambricon"/"Hygon" are ignored). They match when they are equal, or when the shorter
    is a prefix of the longer and the prefix does not end in the middle of a number: "910B" matches
    "Ascend910B3" and "A100" matches "NVIDIA A100-SXM4-40GB", but "A10" does not match "A100" and "910A"
    does not match "910B".
    """
    a, b = normalise_model(declared), normalise_model(observed)
    if not a or not b:
        return a == b
    if a == b:
        return True
    short, long = (a, b) if len(a) < len(b) else (b, a)
    if not long.startswith(short):
        return False
    return not (short[-1].isdigit() and long[len(short)].isdigit())


def cross_check(
    device_type: str,
    tool: str,
    declared_index: int,
    declared_model: str,
    declared_memory_mb: int,
    observed: Sequence[ObservedDevice],
) -> list[Message]:
    """Reasons why a declared device does not match what the tool reports; empty when it matches.

    The device is looked up by index. Memory may differ by at most 5 % of the declared size (tools report
    a little less than the nominal size). Models are compared with `models_match`. Each reason is a
    message (str() of it: the English text), which kunlun-cli and kunlun-device-probe translate.
    """
    name = f"{device_type}:{declared_index}"
    match = next((d for d in observed if d.index == declared_index), None)
    if match is None:
        indexes = ", ".join(str(d.index) for d in sorted(observed, key=lambda d: d.index))
        return [
            msg(
                "device.check.not_found",
                "{name} declared but not found by {tool} (indexes it reports: {found})",
                name=name,
                tool=tool,
                found=indexes or msg("device.check.no_index", "none"),
            )
        ]
    reasons: list[Message] = []
    if not models_match(declared_model, match.model):
        reasons.append(
            msg(
                "device.check.model",
                "{name}: declared model {declared!r}, {tool} reports {observed!r}",
                name=name,
                declared=declared_model,
                tool=tool,
                observed=match.model,
            )
        )
    if match.memory_total_mb is not None:
        if abs(match.memory_total_mb - declared_memory_mb) > MEMORY_TOLERANCE * declared_memory_mb:
            reasons.append(
                msg(
                    "device.check.memory",
                    "{name}: declared {declared} MB, {tool} reports {observed} MB",
                    name=name,
                    declared=declared_memory_mb,
                    tool=tool,
                    observed=match.memory_total_mb,
                )
            )
    return reasons
