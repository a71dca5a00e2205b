"""The executor: keep the engines of this node equal to the instances the scheduler assigned to it.

The replica pushes the node's FULL assignment set on registration and on every change; `assign()`
records it and the reconcile loop (idempotent, it never raises) then:

* starts a worker (`instance.InstanceWorker`) for every assigned instance that has none;
* stops the worker of every instance no longer assigned, or whose assignment changed (fingerprint of
  generation, devices and spec, `replicas` left out so scaling never restarts the others), and
  removes the instance dir once an unassigned instance is stopped;
* at the first assignments after the agent started, adopts the engines a previous agent left running
  (`<state_dir>/instances/<id>`, live supervisor found through /proc, same fingerprint in `agent.json`):
  same engine pids, never a second copy; the others are stopped and their dirs removed.

Stop on disconnect: once no replica has been reached for `disconnect_stop_s` (default 5 s; with the
fence slack and the stop grace below the 5 s node lease + 8 s node grace, after which the instances
may be placed elsewhere) every engine is
stopped (phase Stopped) and nothing starts again until assignments arrive on a new stream. The
report sent after the reconnect carries `note` saying when and why (kept for NOTE_KEEP_S).

`report()` is the node's whole InstanceReport (every current instance, the node's protections and the
note); `changed` is set whenever it differs. On simulated nodes the stand-in chips' memory used and
utilization follow the engines (the same telemetry path as real hardware), through the `chip_usage`
hook the simulator's wiring injects.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import shutil
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from kunlun_common.api import agent_pb2, workload_pb2
from kunlun_common.messages import msg
from kunlun_common.names import parse_device_name
from kunlun_common.states import SERVING, InstancePhase
from node_agent.executor.instance import InstanceWorker, read_saved
from node_agent.executor.prepare import NodeContext
from node_agent.executor.simload import LOAD_POLL_S, EngineLoad
from node_agent.executor.supervisor_api import SupervisorHandle, adopt, alive, reap, stop
from node_agent.simulation import ChipUsage

log = structlog.get_logger("executor")
NOTE_KEEP_S = 600.0
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
STARTING_UTILIZATION, RUNNING_UTILIZATION = 5.0, 35.0


def fingerprint(a: agent_pb2.Assignment) -> str:
    """What makes a running engine stale when it changes (not `replicas`: scaling restarts nothing)."""
    spec = workload_pb2.WorkloadSpec()
    spec.CopyFrom(a.spec)
    spec.ClearField("replicas")
    h = hashlib.sha256()
    for part in (a.instance_id, a.workload_id, str(a.generation), ",".join(a.devices)):
        h.update(part.encode() + b"\0")
    h.update(spec.SerializeToString(deterministic=True))
    return h.hexdigest()[:20]


def available(a: agent_pb2.Assignment) -> bool:
    """Whether the instance's workload chose `fencing: available`: its engine keeps serving while
    the agent has no contact with any replica (no self-fence, no stop on disconnect)."""
    return a.spec.fencing == "available"


@dataclass
class Orphan:
    """An instance dir found at start-up, before the first assignments say whether it is still wanted."""

    handle: SupervisorHandle | None
    saved: dict[str, Any] | None

    @property
    def fingerprint(self) -> str:
        return str((self.saved or {}).get("fingerprint", ""))


class ExecutorManager:
    """Reconciles assigned instances with running engines (see the module docstring)."""

    def __init__(
        self,
        ctx: NodeContext,
        protections: Sequence[str],
        seconds_since_contact: Callable[[], float],
        chip_usage: ChipUsage | None = None,
        fence_deadline_s: float = 0.0,
    ) -> None:
        self.ctx = ctx
        self.fence_deadline_s = fence_deadline_s
        self.protections = list(protections)
        self.seconds_since_contact = seconds_since_contact
        self.chip_usage = chip_usage  # simulated nodes: injected by the simulator's wiring
        self.workers: dict[str, InstanceWorker] = {}
        self.retiring: dict[str, asyncio.Task[None]] = {}
        self.orphans: dict[str, Orphan] = {}
        self.desired: dict[str, agent_pb2.Assignment] = {}
        self.received = False
        self.suspended = False
        self.note = ""
        self.note_until: float | None = None
        self.revision = 0
        self.cluster_id = 0
        self.changed = asyncio.Event()
        self._wake = asyncio.Event()
        self._chips_dirty = asyncio.Event()
        self._chips_written: dict[tuple[str, int], tuple[int, float]] = {}
        self._load = EngineLoad()
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------------------------ inputs

    def assign(self, msg: agent_pb2.Assignments) -> bool:
        """The node's full assignment set (from the replica); False when it was ignored because it
        is older than the newest applied, ordered by (etcd cluster id, revision). A new cluster id
        (a restore from backup) resets the mark."""
        if msg.cluster_id == self.cluster_id and msg.revision < self.revision:
            log.warning(
                "ignoring an assignment set older than the one applied (a lagging replica)",
                revision=msg.revision,
                applied_revision=self.revision,
                cluster_id=f"{msg.cluster_id:x}",
            )
            return False
        if self.cluster_id and msg.cluster_id != self.cluster_id:
            log.warning(
                "assignments from another etcd cluster id: the revision mark is reset",
                old=f"{self.cluster_id:x}",
                new=f"{msg.cluster_id:x}",
                revision=msg.revision,
            )
        self.cluster_id, self.revision = msg.cluster_id, msg.revision
        self.desired = {a.instance_id: a for a in msg.items}
        if self.suspended:
            self.suspended = False
            self.note_until = time.monotonic() + NOTE_KEEP_S
            log.info("assignments received again; resuming", instances=len(self.desired))
        self.received = True
        self._wake.set()
        return True

    def packages_in_use(self) -> set[str]:
        """Hex digests of the packages the assigned instances (and the running workers) name."""
        specs = [a.spec for a in self.desired.values()] + [w.assignment.spec for w in self.workers.values()]
        return {s.package.rsplit(":", 1)[-1] for s in specs if s.package}

    def instance_dir(self, instance_id: str) -> Path | None:
        """The dir of an instance on this node (for its logs), or None."""
        if not _ID_RE.match(instance_id):
            return None
        d = self.ctx.instances_dir / instance_id
        return d if d.is_dir() else None

    # ------------------------------------------------------------------------------------ output

    def report(self) -> agent_pb2.InstanceReport:
        """Every current instance's status, the node's protections and the note."""
        if self.note and self.note_until is not None and time.monotonic() > self.note_until:
            self.note, self.note_until = "", None
        out = agent_pb2.InstanceReport(protections=self.protections, note=self.note)
        for iid in sorted(self.workers):
            out.instances.add().CopyFrom(self.workers[iid].status)
        return out

    def _on_change(self) -> None:
        self.changed.set()
        self._chips_dirty.set()

    # ------------------------------------------------------------------------------------ running

    async def start(self) -> None:
        """Find what a previous agent left, then start the reconcile, watchdog and chip loops."""
        await asyncio.to_thread(self._scan)
        for name, coro in (
            ("reconcile", self._reconcile_loop()),
            ("disconnect-watchdog", self._watchdog()),
            ("sim-chips", self._chips_loop()),
            ("sim-load", self._load_loop()),
        ):
            self._tasks.append(asyncio.create_task(coro, name=name))
        self._chips_dirty.set()

    async def stop_everything(self, reason: str) -> None:
        """Stop every engine (workers and those left by a previous agent) and wait for it."""
        self.suspended = True  # nothing starts again
        for w in self.workers.values():
            w.request_stop(reason)
        for iid, orphan in list(self.orphans.items()):
            del self.orphans[iid]
            self._retire(iid, self._stop_orphan(iid, orphan, reason), remove_dir=False)
        waits = [*(w.task for w in self.workers.values() if w.task), *self.retiring.values()]
        await asyncio.gather(*waits, return_exceptions=True)

    async def close(self) -> None:
        """Stop the loops and workers, leaving the engines running (the next agent adopts them)."""
        tasks = [*self._tasks, *self.retiring.values(), *(w.task for w in self.workers.values() if w.task)]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _scan(self) -> None:
        self.ctx.instances_dir.mkdir(parents=True, exist_ok=True)
        for d in sorted(self.ctx.instances_dir.iterdir()):
            if not d.is_dir() or not _ID_RE.match(d.name):
                continue
            handle = adopt(d)
            if handle is None:
                reap(d)
            self.orphans[d.name] = Orphan(handle, read_saved(d))
        live = sorted(i for i, o in self.orphans.items() if o.handle is not None)
        if self.orphans:
            log.info("instances found from a previous agent", live=live, stale=len(self.orphans) - len(live))

    async def _reconcile_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                self._reconcile()
            except Exception:  # a loop must never die
                log.exception("reconcile failed")

    def _reconcile(self) -> None:
        if not self.received or self.suspended:
            return
        for iid, orphan in list(self.orphans.items()):
            if iid in self.workers or iid in self.retiring:
                continue
            a = self.desired.get(iid)
            del self.orphans[iid]
            same = a is not None and orphan.fingerprint == fingerprint(a)
            if same and a is not None and orphan.handle is not None:
                log.info("adopting engine", instance=iid, engine_pid=orphan.handle.engine_pid)
                self._start_worker(a, orphan.handle, orphan.saved)
            elif not same:
                why = "not assigned" if a is None else "assignment changed"
                self._retire(iid, self._stop_orphan(iid, orphan, why), remove_dir=a is None)
        for iid, w in list(self.workers.items()):
            a = self.desired.get(iid)
            if a is None or fingerprint(a) != w.fingerprint:
                del self.workers[iid]
                w.request_stop(
                    msg("instance.not_assigned", "not assigned to this node")
                    if a is None
                    else msg("instance.assignment_changed", "assignment changed")
                )
                self._retire(iid, self._await_worker(w), remove_dir=a is None)
            elif w.stopping:  # stopped because no replica was reachable: start again once it is done
                if w.done:
                    del self.workers[iid]
            else:
                w.assignment = a
        for iid, a in self.desired.items():
            if iid not in self.workers and iid not in self.retiring:
                saved = read_saved(self.ctx.instances_dir / iid)
                if saved is not None and saved.get("fingerprint") != fingerprint(a):
                    saved = None
                self._start_worker(a, None, saved)
        self._on_change()

    def _start_worker(
        self, a: agent_pb2.Assignment, handle: SupervisorHandle | None, saved: dict[str, Any] | None
    ) -> None:
        fence_s = 0.0 if available(a) else self.fence_deadline_s  # `fencing: available`: no self-fence
        w = InstanceWorker(self.ctx, a, fingerprint(a), self._on_change, handle, saved, fence_s)
        self.workers[a.instance_id] = w
        w.start()
        assert w.task is not None
        w.task.add_done_callback(lambda _t: self._wake.set())

    def _retire(self, iid: str, stopping: Coroutine[Any, Any, None], remove_dir: bool) -> None:
        async def run() -> None:
            try:
                await stopping
                d = self.ctx.instances_dir / iid
                if remove_dir and await asyncio.to_thread(adopt, d) is not None:
                    log.error("engine still alive after its stop; its folder is kept", instance=iid)
                elif remove_dir:
                    await asyncio.to_thread(shutil.rmtree, d, True)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("stopping an instance failed", instance=iid)
            finally:
                if self.retiring.get(iid) is asyncio.current_task():
                    del self.retiring[iid]
                self._wake.set()
                self._on_change()

        self.retiring[iid] = asyncio.create_task(run(), name=f"retire-{iid}")

    async def _await_worker(self, w: InstanceWorker) -> None:
        if w.task is not None:
            await w.task
        log.info("instance stopped", instance=w.iid, reason=w.stop_reason)

    async def _stop_orphan(self, iid: str, orphan: Orphan, why: str) -> None:
        if orphan.handle is not None and alive(orphan.handle):
            log.info("stopping engine left by a previous agent", instance=iid, why=why)
            await asyncio.to_thread(stop, orphan.handle, self.ctx.settings.stop_grace_s, None, why)

    # ------------------------------------------------------------------------------------ disconnect

    async def _watchdog(self) -> None:
        limit = self.ctx.settings.disconnect_stop_s
        while True:
            await asyncio.sleep(min(0.25, limit / 4))
            since = self.seconds_since_contact()
            if self.suspended or since < limit:
                continue
            if not self.orphans and not any(not w.done for w in self.workers.values()):
                continue
            try:
                self._suspend(since)
            except Exception:
                log.exception("stopping engines on disconnect failed")

    def _suspend(self, since: float) -> None:
        limit = self.ctx.settings.disconnect_stop_s
        strict = [w for w in self.workers.values() if not available(w.assignment)]
        kept = sum(1 for w in self.workers.values() if available(w.assignment) and w.engine_live)
        engines = sum(1 for w in strict if w.engine_live)
        engines += sum(1 for o in self.orphans.values() if o.handle is not None and alive(o.handle))
        self.suspended, self.received = True, False
        why_message = msg(
            "instance.no_replica_reachable",
            "no replica reachable for {seconds:.0f}s (disconnect_stop_s={limit:g})",
            seconds=since,
            limit=limit,
        )
        why = str(why_message)
        for w in strict:
            w.request_stop(msg("instance.stopped_because", "stopped: {why}", why=why_message))
        for iid, orphan in list(self.orphans.items()):
            if iid not in self.retiring:
                del self.orphans[iid]
                self._retire(iid, self._stop_orphan(iid, orphan, why), remove_dir=False)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.note = f"{engines} engine(s) stopped at {stamp}: {why}" + (
            f"; {kept} kept serving (fencing: available)" if kept else ""
        )
        self.note_until = None
        log.warning(
            "no replica reachable: stopping every engine",
            engines=engines,
            kept_available=kept,
            since_s=round(since, 1),
        )
        self._on_change()

    # ------------------------------------------------------------------------------------ simulated chips

    def _chip_usage(self) -> dict[tuple[str, int], tuple[int, float]]:
        usage: dict[tuple[str, int], tuple[int, float]] = {}
        totals: dict[tuple[str, int], int] = {}
        for d in self.ctx.devices():
            key = (d.device_type, d.index)
            usage[key] = (0, 0.0)
            totals[key] = int(d.hbm_memory_mb or d.total_memory_mb)
        for w in self.workers.values():
            phase = w.status.phase
            if phase not in SERVING:
                continue
            util = RUNNING_UTILIZATION if phase == InstancePhase.RUNNING else STARTING_UTILIZATION
            util += (
                self._load.extra.get(w.assignment.instance_id, 0.0) if phase == InstancePhase.RUNNING else 0.0
            )
            for name in w.assignment.devices:
                with contextlib.suppress(ValueError):
                    p = parse_device_name(name)
                    key = (p.device_type, p.index)
                    if key in usage:
                        mem, u = usage[key]
                        mem = min(totals[key], mem + int(w.assignment.spec.memory_per_device_mb))
                        usage[key] = (mem, min(100.0, u + util))
        return usage

    async def _chips_loop(self) -> None:
        if self.chip_usage is None:
            return
        while True:
            await self._chips_dirty.wait()
            self._chips_dirty.clear()
            want = self._chip_usage()
            changes = {k: v for k, v in want.items() if self._chips_written.get(k) != v}
            if changes:
                await asyncio.to_thread(self._write_chips, changes)

    async def _load_loop(self) -> None:
        """Simulated nodes: follow the Running engines' request rates (`simload`)."""
        if self.chip_usage is None:
            return
        while True:
            await asyncio.sleep(LOAD_POLL_S)
            engines = {
                iid: (self.ctx.address, w.port)
                for iid, w in self.workers.items()
                if w.status.phase == InstancePhase.RUNNING and w.port
            }
            if await self._load.poll(engines):
                self._chips_dirty.set()

    def _write_chips(self, changes: dict[tuple[str, int], tuple[int, float]]) -> None:
        assert self.chip_usage is not None
        for (dtype, index), (mem, util) in changes.items():
            self.chip_usage(dtype, index, mem, util)  # the hook logs and swallows its own failures
            self._chips_written[(dtype, index)] = (mem, util)


def stop_all_instances(instances_dir: Path, grace_s: float = 5.0) -> list[str]:
    """Stop every engine under `<state_dir>/instances` without an agent (teardown of a local cluster
    or a test); returns the instances that had a live supervisor. Blocking."""
    stopped: list[str] = []
    if not instances_dir.is_dir():
        return stopped
    for d in sorted(instances_dir.iterdir()):
        if not d.is_dir():
            continue
        handle = adopt(d)
        if handle is not None:
            stop(handle, grace_s)
            stopped.append(d.name)
        else:
            reap(d)
    return stopped
