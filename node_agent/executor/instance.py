"""One assigned instance on this node: start it, probe it, restart it, stop it; report what happens.

Phases (`InstanceStatus.phase`):

    Pending -> Starting -> Running --(exit, OOM kill, failed liveness)--> CrashLoopBackOff -> Pending ...
       |                                                                                      (restart)
       +--> Failed (cannot start: bad spec, SGLang missing without the fallback...; waits for a new spec)
    any --(unassigned / no replica reachable)--> Stopped

* Pending: allocating the devices and building the launch plan (`prepare.py`); Starting: the
  supervisor runs the engine, which does not answer its health probe yet; Running: after the first
  successful probe (then one tiny generation measures the first-token time).
* A Running engine failing `probe_failure_threshold` probes in a row is stopped and restarted; an
  engine not healthy within `startup_timeout_s` too. An engine that ends is restarted after an
  exponential back-off (`restart_backoff_s` doubled per restart in a row, at most
  `restart_backoff_max_s`, reset after `backoff_reset_s` of running); the phase is CrashLoopBackOff
  while waiting and the reason says why it ended ("OOMKilled" first when the cgroup's OOM counter
  says so) and when it restarts.
* Cancelling the worker's task (the agent exits) leaves the engine running: its supervisor does not
  depend on the agent, and the next agent adopts it. Only `request_stop` stops the engine.

The worker keeps `agent.json` in the instance dir (fingerprint of the assignment, port, status) so a
restarted agent can adopt the engine with its history.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from google.protobuf import json_format

from kunlun_common.api import agent_pb2
from kunlun_common.clock import now_ms
from kunlun_common.errors import KunlunError, PermanentError, TemporaryError
from kunlun_common.messages import Message, from_stored, msg, msg_list, of_error, plain, to_stored
from kunlun_common.states import ExitCause, InstancePhase
from node_agent.executor import devlock
from node_agent.executor.prepare import NodeContext, PrepareError, prepare
from node_agent.executor.probes import endpoint, first_token_ms, probe_health
from node_agent.executor.supervisor_api import (
    ExitRecord,
    SupervisorHandle,
    adopt,
    alive,
    atomic_write_json,
    launch,
    read_exit,
    stop,
)

log = structlog.get_logger("executor")
AGENT_FILE = "agent.json"
LAUNCH_TIMEOUT_S = 60.0
DEVICE_POLL_S = 0.25
STOP_RETRY_S = 2.0


@dataclass(frozen=True)
class Ended:
    """Why an engine run ended (or could not start)."""

    why: Message
    """The reason as a message (its English text is `reason`)."""
    exit_code: int = 0
    oom_killed: bool = False
    ran_s: float = 0.0

    @property
    def reason(self) -> str:
        return str(self.why)


def joined(parts: list[Message]) -> Message:
    """Reasons shown one after the other ("a; b"), each translated on its own."""
    return (
        parts[0] if len(parts) == 1 else msg_list("instance.reasons", "{parts}", parts, bullet="", sep="; ")
    )


def describe_exit(record: ExitRecord | None) -> Ended:
    """An exit record in words; OOM kills (from the cgroup counter) are "OOMKilled"."""
    if record is None:
        return Ended(
            msg(
                "instance.supervisor_vanished",
                "the supervisor vanished without recording how the engine ended",
            )
        )
    ran = max(0.0, record.finished_at - record.started_at)
    sig = record.signal
    code = record.exit_code if record.exit_code is not None else (128 + sig if sig else 0)
    if record.cause == ExitCause.OOM_KILLED or record.oom_killed:
        return Ended(plain("OOMKilled"), 128 + signal.SIGKILL, True, ran)
    if record.cause == ExitCause.FAILED:
        return Ended(
            msg(
                "instance.engine_could_not_start", "engine could not start: {message}", message=record.message
            ),
            code,
            False,
            ran,
        )
    if record.cause == ExitCause.SIGNALED and sig:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return Ended(
            msg("instance.engine_killed_by", "engine was killed by {name}", name=name), code, False, ran
        )
    if record.cause == ExitCause.STOPPED:
        if record.message:
            why = msg("instance.engine_stopped", "engine stopped: {message}", message=record.message)
        else:
            why = msg("instance.engine_stopped_by_supervisor", "engine stopped: by its supervisor")
        return Ended(why, code, False, ran)
    return Ended(msg("instance.engine_exited", "engine exited with code {code}", code=code), code, False, ran)


class InstanceWorker:
    """Runs one assigned instance until asked to stop (see the module docstring)."""

    def __init__(
        self,
        ctx: NodeContext,
        assignment: agent_pb2.Assignment,
        fingerprint: str,
        on_change: Callable[[], None],
        handle: SupervisorHandle | None = None,
        saved: dict[str, Any] | None = None,
        fence_deadline_s: float = 0.0,
    ) -> None:
        self.ctx = ctx
        self.fence_deadline_s = fence_deadline_s
        self.assignment = assignment
        self.fingerprint = fingerprint
        self.on_change = on_change
        self.iid = assignment.instance_id
        self.dir = ctx.instances_dir / self.iid
        self.handle = handle
        self.port = 0
        self.note = ""
        self.note_message: Message | None = None
        self.attempt = 0
        self.last_end: Message | None = None
        self.stop_reason = ""
        self.stop_message: Message | None = None
        self.status = agent_pb2.InstanceStatus(
            instance_id=self.iid, workload_id=assignment.workload_id, phase=InstancePhase.PENDING
        )
        self._stop = asyncio.Event()
        self._ftl: asyncio.Task[None] | None = None
        self.task: asyncio.Task[None] | None = None
        if saved:
            self._restore(saved)
        if handle is not None:
            self.status.phase = InstancePhase.STARTING
            self.status.pid = handle.engine_pid or 0

    # ------------------------------------------------------------------------------------ state

    def _restore(self, saved: dict[str, Any]) -> None:
        self.port = int(saved.get("port", 0))
        self.note = str(saved.get("note", ""))
        self.note_message = from_stored(str(saved.get("note_message", "")), self.note)
        with contextlib.suppress(json_format.ParseError):
            json_format.ParseDict(saved.get("status", {}), self.status, ignore_unknown_fields=True)
        self.status.instance_id = self.iid
        self.status.workload_id = self.assignment.workload_id

    def _persist(self) -> None:
        if not self.dir.is_dir():
            return
        data = {
            "fingerprint": self.fingerprint,
            "port": self.port,
            "note": self.note,
            "note_message": to_stored(self.note_message) if self.note_message else "",
            "status": json_format.MessageToDict(self.status, preserving_proto_field_name=True),
        }
        try:
            atomic_write_json(self.dir / AGENT_FILE, data, mode=0o600)
        except OSError as e:
            log.warning("could not save instance state", instance=self.iid, error=str(e))

    def _set(self, **fields: Any) -> None:
        """Set status fields; a `reason` given as a message sets its English text and
        `reason_message` (for the CLI to translate), one given as text clears `reason_message`."""
        if "reason" in fields:
            why = fields["reason"]
            if isinstance(why, Message):
                fields["reason"], fields["reason_message"] = str(why), to_stored(why)
            else:
                fields["reason_message"] = ""
        changed = False
        for name, value in fields.items():
            if name in ("command", "env_names", "device_nodes"):
                if list(getattr(self.status, name)) != list(value):
                    del getattr(self.status, name)[:]
                    getattr(self.status, name).extend(value)
                    changed = True
            elif getattr(self.status, name) != value:
                setattr(self.status, name, value)
                changed = True
        if changed:
            if "phase" in fields:
                log.info(
                    "instance phase",
                    instance=self.iid,
                    phase=self.status.phase,
                    reason=self.status.reason,
                    pid=self.status.pid,
                )
            self._persist()
            self.on_change()

    def _reason(self, *parts: Message | None) -> Message | str:
        """`parts` and the instance's note one after the other; "" when there is none."""
        shown = [p for p in parts if p is not None and str(p)]
        if self.note:
            shown.append(self.note_message or plain(self.note))
        return joined(shown) if shown else ""

    @property
    def engine_live(self) -> bool:
        """Whether an engine (its supervisor) runs for this instance now."""
        return self.handle is not None and alive(self.handle)

    # ------------------------------------------------------------------------------------ control

    def start(self) -> None:
        self.task = asyncio.create_task(self.run(), name=f"instance-{self.iid}")

    def request_stop(self, reason: str | Message) -> None:
        """Stop the engine and end the worker (phase Stopped with `reason`)."""
        if not self._stop.is_set():
            self.stop_reason = str(reason)
            self.stop_message = reason if isinstance(reason, Message) else None
            self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def done(self) -> bool:
        return self.task is not None and self.task.done()

    async def _sleep(self, seconds: float) -> bool:
        """Wait `seconds`; True when a stop was requested meanwhile."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)
        return self._stop.is_set()

    # ------------------------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """The worker's task: never raises (but CancelledError, which leaves the engine running)."""
        try:
            await self._run()
        except asyncio.CancelledError:
            if self._ftl is not None:
                self._ftl.cancel()
            raise

    async def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ended = await self._once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the worker must never die: treat it as a crash and retry
                log.exception("instance worker error", instance=self.iid)
                ended = Ended(
                    msg(
                        "instance.agent_error",
                        "agent error: {kind}: {error}",
                        kind=type(e).__name__,
                        error=str(e),
                    )
                )
            if ended is None:
                break
            await self._backoff(ended)
        await self._shutdown()

    async def _once(self) -> Ended | None:
        """Start (or adopt) the engine and watch it; None when a stop was requested or it Failed."""
        if self.handle is not None and not alive(self.handle):
            ended = describe_exit(read_exit(self.dir))
            self.handle = None
            return ended
        if self.handle is None:
            started = await self._start()
            if started is not None or self.handle is None:
                return started
        return await self._watch()

    async def _start(self) -> Ended | None:
        after = (
            msg(
                "instance.restart_after",
                "restart {restarts} after {last_end}",
                restarts=self.status.restarts,
                last_end=self.last_end,
            )
            if self.last_end is not None
            else None
        )
        self._set(phase=InstancePhase.PENDING, reason=after or msg("instance.preparing", "preparing"), pid=0)
        t0 = time.monotonic()
        try:
            prep = await prepare(self.ctx, self.assignment, self.port, lambda m: self._set(reason=m))
        except PrepareError as e:
            if not e.permanent:
                return Ended(of_error(e))
            self._set(phase=InstancePhase.FAILED, reason=of_error(e))
            await self._stop.wait()
            return None
        self.port, self.note, self.note_message = prep.port, str(prep.note or ""), prep.note or None
        self._set(
            endpoint=endpoint(self.ctx.address, prep.port),
            command=list(prep.spec.argv),
            env_names=list(prep.env_names),
            device_nodes=list(prep.plan.device_nodes),
        )
        state_dir = self.ctx.instances_dir.parent
        spec = dataclasses.replace(
            prep.spec,
            node=self.ctx.node,
            devices=tuple(self.assignment.devices),
            agent_state_dir=str(state_dir),
            fence_deadline_s=self.fence_deadline_s,
        )
        if await self._wait_for_devices(state_dir / devlock.LOCK_DIR, list(self.assignment.devices)):
            return None
        self.dir.mkdir(parents=True, exist_ok=True)
        self._persist()  # before the launch: a restarted agent must recognise the supervisor
        try:
            self.handle = await asyncio.to_thread(launch, spec, LAUNCH_TIMEOUT_S)
        except TemporaryError as e:
            self.handle = await asyncio.to_thread(adopt, self.dir)
            if self.handle is None:
                return Ended(of_error(e))
        except PermanentError as e:
            record = read_exit(self.dir)
            return describe_exit(record) if record is not None else Ended(of_error(e))
        self._set(
            phase=InstancePhase.STARTING,
            reason=self._reason(after),
            pid=self.handle.engine_pid or 0,
            started_at_unix_ms=int(self.handle.started_at * 1000),
            ready_at_unix_ms=0,
            prepare_seconds=round(time.monotonic() - t0, 3),
        )
        return None

    async def _wait_for_devices(self, lock_dir: Path, devices: list[str]) -> bool:
        """Wait while an earlier engine still holds one of our devices (its phase reason says so);
        True when a stop was requested meanwhile."""
        while (held := await asyncio.to_thread(devlock.busy, lock_dir, devices)) is not None:
            who = await asyncio.to_thread(devlock.holder, lock_dir, held)
            self._set(
                phase=InstancePhase.PENDING,
                reason=msg(
                    "instance.waiting_for_device",
                    "waiting for device {device}: still held by {holder}",
                    device=held,
                    holder=who or msg("instance.an_engine", "an engine"),
                ),
            )
            if await self._sleep(DEVICE_POLL_S):
                return True
        return False

    async def _watch(self) -> Ended | None:
        assert self.handle is not None
        s = self.ctx.settings
        host = self.ctx.address
        ready_since: float | None = None
        failures = 0
        watching_since = time.monotonic()
        adopted = self.status.phase == InstancePhase.STARTING and self.status.ready_at_unix_ms > 0
        while True:
            if await self._sleep(s.probe_interval_s):
                return None
            if not alive(self.handle):
                ended = describe_exit(read_exit(self.dir))
                if ready_since is not None:
                    ended = dataclasses.replace(ended, ran_s=time.monotonic() - ready_since)
                self.handle = None
                return ended
            error = await probe_health(host, self.port, s.health_path, s.probe_timeout_s)
            if error is None:
                failures = 0
                if ready_since is None:
                    ready_since = time.monotonic()
                    ready_at = self.status.ready_at_unix_ms if adopted else now_ms()
                    self._set(phase=InstancePhase.RUNNING, reason=self._reason(), ready_at_unix_ms=ready_at)
                    if not adopted or not self.status.first_token_ms:
                        self._ftl = asyncio.create_task(self._measure_first_token(), name=f"ftl-{self.iid}")
                continue
            if ready_since is not None:
                failures += 1
                log.warning("liveness probe failed", instance=self.iid, failures=failures, error=error)
                if failures >= s.probe_failure_threshold:
                    await self._stop_engine()
                    return Ended(
                        msg(
                            "instance.liveness_failed",
                            "liveness probe failed {failures} times in a row ({error})",
                            failures=failures,
                            error=error,
                        ),
                        ran_s=time.monotonic() - ready_since,
                    )
            elif time.monotonic() - watching_since > s.startup_timeout_s:
                await self._stop_engine()
                return Ended(
                    msg(
                        "instance.not_healthy",
                        "not healthy {seconds:g}s after its start ({error})",
                        seconds=s.startup_timeout_s,
                        error=error,
                    )
                )

    async def _measure_first_token(self) -> None:
        ms = await first_token_ms(self.ctx.address, self.port, self.assignment.spec.name)
        if ms is None:
            log.warning("first-token measurement failed", instance=self.iid)
            return
        self._set(first_token_ms=round(ms, 2))

    async def _backoff(self, ended: Ended) -> None:
        s = self.ctx.settings
        if ended.ran_s >= s.backoff_reset_s:
            self.attempt = 0
        delay = min(s.restart_backoff_max_s, s.restart_backoff_s * (2**self.attempt))
        self.attempt += 1
        self.last_end = ended.why
        log.warning(
            "instance ended; restarting after back-off", instance=self.iid, why=ended.reason, delay=delay
        )
        self._set(
            phase=InstancePhase.CRASH_LOOP,
            reason=msg(
                "instance.restart_in",
                "{why}; restart {restart} in {delay:.1f}s",
                why=ended.why,
                restart=self.status.restarts + 1,
                delay=delay,
            ),
            pid=0,
            exit_code=ended.exit_code,
            oom_killed=ended.oom_killed,
            restarts=self.status.restarts + 1,
        )
        await self._sleep(delay)

    async def _stop_engine(self) -> str | None:
        """Stop the engine; None when it is gone, else why it could not be stopped (the handle is
        kept so the caller can try again: an engine is never forgotten while it may run)."""
        if self._ftl is not None:
            self._ftl.cancel()
        handle = self.handle
        if handle is not None:
            try:
                record = await asyncio.to_thread(
                    stop, handle, self.ctx.settings.stop_grace_s, None, self.stop_reason
                )
            except (OSError, KunlunError) as e:
                log.error("could not stop the engine", instance=self.iid, error=str(e))
                return f"{type(e).__name__}: {e}"
            if alive(handle):
                return f"supervisor pid {handle.supervisor_pid} still alive after the stop"
            log.info("engine stopped", instance=self.iid, cause=record.cause if record else None)
        self.handle = None
        return None

    async def _shutdown(self) -> None:
        while (failure := await self._stop_engine()) is not None:
            self._set(
                reason=msg(
                    "instance.stop_failed",
                    "stop failed ({failure}); retrying in {seconds:g}s",
                    failure=failure,
                    seconds=STOP_RETRY_S,
                )
            )
            await asyncio.sleep(STOP_RETRY_S)
        self._set(phase=InstancePhase.STOPPED, reason=self.stop_message or self.stop_reason, pid=0)


def read_saved(instance_dir: Path) -> dict[str, Any] | None:
    """The worker's `agent.json` of an instance dir, or None."""
    try:
        data = json.loads((instance_dir / AGENT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
