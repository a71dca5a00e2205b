"""From one assignment to the supervisor spec that runs it: devices, launch plan, engine, limits, port.

Per instance, in order: the device plugin of the assigned devices' type allocates them (visibility
variable, device nodes, engine hints); `launch_plan.build_launch_plan` turns the workload spec and that
answer into the engine's command line and environment; the engine is chosen; the sandbox and cgroup
settings are added. Errors that retrying cannot fix (a bad template, an unknown dtype, SGLang missing
without the fallback) are `PrepareError(permanent=True)`: the instance is Failed with the reason.

Engines (`spec.engine`):

* `sglang` (default): SGLang's launch plan. When the engine interpreter (`--engine-python`) cannot
  import `sglang`, the agent started with `--test-engine-fallback` runs kunlun-test-engine with the
  same arguments instead (and says so in the instance's reason); without the flag the instance is
  Failed, naming the node and the fix.
* `template`: `spec.command_template` with its placeholders (see `launch_plan`).
* `test`: the built-in test engine (kunlun-test-engine) under the agent's own interpreter; what
  `kunlun-cli verify` deploys.

Workload values mapped to SGLang's: dtype fp16/bf16/fp32 -> float16/bfloat16/float32; quantization
none -> (the checkpoint's own), fp8 -> fp8, w8a8/int8 -> w8a8_int8, int4 -> (the checkpoint's own:
SGLang reads AWQ/GPTQ from its config); SGLang's own names pass through unchanged.

Host resources of one instance (cgroup; `memory_per_device_mb` is accelerator memory, not host RAM):
the spec's env `KUNLUN_MEMORY_LIMIT_MB` (host-memory limit, MiB) and `KUNLUN_CPU_CORES` (CPU limit),
else the agent's `--engine-memory-limit-mb` / `--engine-cpu-cores` (default: unlimited but accounted,
so an OOM kill is still seen); tasks are capped at `pids_max`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from google.protobuf import json_format

from kunlun_common.api import agent_pb2, types_pb2
from kunlun_common.errors import ConfigError, KunlunError
from kunlun_common.messages import Message, msg, of_error
from kunlun_common.names import parse_device_name
from node_agent.executor import packages
from node_agent.executor.cgroups import CgroupLimits
from node_agent.executor.launch_plan import EngineRequest, LaunchPlan, LaunchSettings, build_launch_plan
from node_agent.executor.package_cache import CacheFull, PackageCache, PullFailed
from node_agent.executor.sandbox import SandboxSettings, build_env
from node_agent.executor.supervisor_api import SupervisorSpec
from node_agent.plugins.contract import AllocateResult, DevicePlugin
from node_agent.settings import ExecutorSettings

MEMORY_LIMIT_ENV = "KUNLUN_MEMORY_LIMIT_MB"
CPU_CORES_ENV = "KUNLUN_CPU_CORES"
TEST_ENGINE_MODULE = "node_agent.testengine"
ALLOCATE_TIMEOUT_S = 30.0
_REPO_ROOT = Path(__file__).resolve().parents[2]
_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
_QUANTIZATIONS: dict[str, str | None] = {
    "": None,
    "none": None,
    "fp8": "fp8",
    "w8a8": "w8a8_int8",
    "int8": "w8a8_int8",
    "int4": None,
}


class PrepareError(KunlunError):
    """The instance cannot be started now; `permanent` when retrying the same assignment cannot help."""

    def __init__(self, message: str | Message, permanent: bool) -> None:
        super().__init__(message)
        self.permanent = permanent


@dataclass(frozen=True)
class NodeContext:
    """What preparing an instance needs to know about the node."""

    node: str
    """Node name."""
    address: str
    """The node's cluster address: engines listen there."""
    instances_dir: Path
    """`<state_dir>/instances`."""
    cache_root: Path | None
    """Root of the compilation caches (`<state_dir>/cache`)."""
    settings: ExecutorSettings
    """Executor settings."""
    sandbox: SandboxSettings
    """Sandbox settings, restricted to what the node can enforce."""
    cgroups: bool
    """Whether any cgroup controller is usable (else instances run without a cgroup)."""
    devices: Callable[[], list[types_pb2.Device]]
    """The node's devices now."""
    plugin: Callable[[str], DevicePlugin | None]
    """The plugin serving a device type now."""
    package_cache: PackageCache | None = None
    """The node's package cache (pulls through the control plane); None: packages only from the
    node's `packages/incoming/` folder, checked with the agent's own flags."""


@dataclass(frozen=True)
class Prepared:
    """The supervisor spec of one start, and what the status reports of it."""

    spec: SupervisorSpec
    plan: LaunchPlan
    env_names: tuple[str, ...]
    """Names of the engine's whole environment (allowlisted + spec + plugin), never values."""
    note: Message | None
    """Said in the status reason while it runs (e.g. the test-engine fallback); None otherwise."""
    port: int


def pick_port(address: str, preferred: int = 0) -> int:
    """`preferred` when it is free on `address`, else a free port the OS picks."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    for port in (preferred, 0) if preferred else (0,):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as engines do: TIME_WAIT is no obstacle
            try:
                s.bind((address, port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise PrepareError(
        msg("prepare.no_free_port", "no free TCP port on {address}", address=address), permanent=False
    )


_sglang_cache: dict[str, tuple[float, str | None]] = {}


def sglang_problem(python: str, ttl_s: float = 60.0) -> str | None:
    """None when `python` can import sglang; otherwise why not (cached for `ttl_s`)."""
    cached = _sglang_cache.get(python)
    if cached is not None and time.monotonic() - cached[0] < ttl_s:
        return cached[1]
    code = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('sglang') else 3)"
    try:
        rc = subprocess.run([python, "-c", code], capture_output=True, timeout=30, check=False).returncode
        problem = None if rc == 0 else f"{python} cannot import sglang"
    except FileNotFoundError:
        problem = f"{python} not found"
    except (OSError, subprocess.TimeoutExpired) as e:
        problem = f"{python} could not be run ({e})"
    _sglang_cache[python] = (time.monotonic(), problem)
    return problem


def _limit(env: Mapping[str, str], name: str, default: float | None, kind: type) -> float | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw) if kind is float else int(raw)
    except ValueError:
        raise PrepareError(
            msg("prepare.env_not_a_number", "env {name}={raw!r} is not a number", name=name, raw=raw),
            permanent=True,
        ) from None
    if value <= 0:
        raise PrepareError(
            msg("prepare.env_not_positive", "env {name}={raw!r} must be positive", name=name, raw=raw),
            permanent=True,
        )
    return value


def _devices(ctx: NodeContext, names: list[str]) -> tuple[str, list[types_pb2.Device]]:
    if not names:
        raise PrepareError(msg("prepare.no_device", "the assignment names no device"), permanent=True)
    known = {d.name: d for d in ctx.devices()}
    types: set[str] = set()
    out: list[types_pb2.Device] = []
    for name in names:
        try:
            parsed = parse_device_name(name)
        except ValueError:
            raise PrepareError(
                msg(
                    "prepare.bad_device_name",
                    "invalid device name {name!r}: expected <node>/<type>:<index>, e.g. node-a/ascend:0",
                    name=name,
                ),
                permanent=True,
            ) from None
        if parsed.node != ctx.node or name not in known:
            raise PrepareError(
                msg(
                    "prepare.not_this_node", "{name} is not a device of node {node}", name=name, node=ctx.node
                ),
                permanent=True,
            )
        types.add(parsed.device_type)
        out.append(known[name])
    if len(types) > 1:
        raise PrepareError(
            msg(
                "prepare.mixed_types",
                "one instance cannot mix device types ({types})",
                types=", ".join(sorted(types)),
            ),
            permanent=True,
        )
    return types.pop(), out


def _engine_request(
    a: agent_pb2.Assignment,
    device_type: str,
    devs: list[types_pb2.Device],
    alloc: AllocateResult,
    host: str,
    port: int,
) -> EngineRequest:
    spec = a.spec
    quant = spec.quantization.strip().lower()
    attrs = (
        json_format.MessageToDict(devs[0].custom_attributes) if devs[0].HasField("custom_attributes") else {}
    )
    return EngineRequest(
        workload_name=spec.name,
        model=spec.model,
        engine=spec.engine or "sglang",
        command_template=spec.command_template or None,
        quantization=_QUANTIZATIONS[quant] if quant in _QUANTIZATIONS else quant,
        dtype=_DTYPES.get(spec.dtype.strip().lower(), spec.dtype.strip().lower()) or None,
        tp_size=max(1, spec.devices_per_instance or len(devs)),
        device_type=device_type,
        device_model=devs[0].model,
        envs=dict(alloc.envs),
        device_nodes=list(alloc.device_nodes),
        engine_hints=list(alloc.engine_args),
        custom_attributes=attrs,
        host=host,
        port=port,
        extra_args=list(spec.engine_args),
    )


async def package_for(
    ctx: NodeContext, a: agent_pb2.Assignment, progress: Callable[[Message], None]
) -> packages.Unpacked:
    """The verified, unpacked model package of the spec (see packages.py, package_cache.py); refused:
    Failed for good; not pullable now or no room in the cache: retried after a back-off."""
    s = ctx.settings
    what = a.spec.package[:40]
    try:
        if ctx.package_cache is not None:
            return await ctx.package_cache.resolve(a.spec.package, progress)
        return await packages.resolve(
            ctx.instances_dir, a.spec.package, s.trusted_keys_dir, s.require_signed_packages
        )
    except (PullFailed, CacheFull) as e:
        why = msg("prepare.package_problem", "package {package}…: {error}", package=what, error=of_error(e))
        raise PrepareError(why, permanent=False) from None
    except (packages.PackageRefused, KunlunError) as e:
        why = msg("prepare.package_problem", "package {package}…: {error}", package=what, error=of_error(e))
        raise PrepareError(why, permanent=True) from None


async def prepare(
    ctx: NodeContext,
    a: agent_pb2.Assignment,
    preferred_port: int,
    progress: Callable[[Message], None] = lambda _: None,
) -> Prepared:
    """Allocate the devices and build the supervisor spec of one start (raises PrepareError);
    `progress` is told what takes time (a package pull) in words."""
    s = ctx.settings
    device_type, devs = _devices(ctx, list(a.devices))
    pkg = await package_for(ctx, a, progress) if a.spec.package else None  # before any device is touched
    plugin = ctx.plugin(device_type)
    if plugin is None:
        raise PrepareError(
            msg(
                "prepare.no_plugin",
                "no device plugin serves {device_type} devices on {node} now",
                device_type=device_type,
                node=ctx.node,
            ),
            permanent=False,
        )
    try:
        async with asyncio.timeout(ALLOCATE_TIMEOUT_S):
            alloc = await plugin.allocate(list(a.devices))
    except TimeoutError:
        raise PrepareError(
            msg(
                "prepare.allocate_timeout",
                "device plugin {plugin} did not answer Allocate in time",
                plugin=plugin.name,
            ),
            False,
        ) from None
    except KunlunError as e:
        raise PrepareError(
            msg(
                "prepare.plugin_refused",
                "device plugin {plugin}: {error}",
                plugin=plugin.name,
                error=of_error(e),
            ),
            permanent=True,
        ) from None
    except Exception as e:  # an out-of-process plugin may fail in any way; it may come back
        raise PrepareError(
            msg(
                "prepare.allocate_failed",
                "device plugin {plugin} failed to allocate: {error}",
                plugin=plugin.name,
                error=str(e),
            ),
            permanent=False,
        ) from None
    port = await asyncio.to_thread(pick_port, ctx.address, preferred_port)
    req = _engine_request(a, device_type, devs, alloc, ctx.address, port)
    if pkg is not None:
        req = replace(req, model=str(pkg.model_dir))
    try:
        plan = build_launch_plan(
            req, LaunchSettings(python=s.engine_python, engine_version="sglang", cache_root=ctx.cache_root)
        )
    except ConfigError as e:
        raise PrepareError(
            msg("prepare.bad_workload", "workload {name}: {error}", name=a.spec.name, error=of_error(e)),
            permanent=True,
        ) from None
    argv, env = plan.argv, dict(plan.env)
    note: Message | None = None
    if req.engine == "test":  # the agent's own interpreter: the engine python need not have this package
        argv = (sys.executable, *plan.argv[1:])
        env["PYTHONPATH"] = str(_REPO_ROOT)
        note = msg("prepare.test_engine", "serving with kunlun-test-engine (the built-in test engine)")
    if req.engine == "sglang":
        problem = await asyncio.to_thread(sglang_problem, s.engine_python)
        if problem is not None and not s.test_engine_fallback:
            raise PrepareError(
                msg(
                    "prepare.no_sglang",
                    "SGLang is not installed on {node} ({problem}): install SGLang into the engine "
                    "environment (or point the agent's --engine-python at one that has it), or start the "
                    "agent with --test-engine-fallback to serve with kunlun-test-engine",
                    node=ctx.node,
                    problem=problem,
                ),
                permanent=True,
            )
        if problem is not None:
            argv = (sys.executable, "-m", TEST_ENGINE_MODULE, *plan.argv[3:])
            env["PYTHONPATH"] = str(_REPO_ROOT)
            note = msg(
                "prepare.sglang_fallback",
                "SGLang is not installed on {node}: serving with kunlun-test-engine (a test engine)",
                node=ctx.node,
            )
    if plan.cache_dir is not None:
        await asyncio.to_thread(plan.cache_dir.mkdir, parents=True, exist_ok=True)
        if pkg is not None:
            await asyncio.to_thread(packages.seed_cache, pkg, plan.cache_dir)
    spec_env = dict(a.spec.env)
    limits = None
    if ctx.cgroups:
        memory = _limit(spec_env, MEMORY_LIMIT_ENV, s.memory_limit_mb, int)
        limits = CgroupLimits(
            memory_bytes=int(memory) * 1024 * 1024 if memory else None,
            pids_max=s.pids_max,
            cpu_cores=_limit(spec_env, CPU_CORES_ENV, s.cpu_cores, float),
        )
    sup = SupervisorSpec(
        instance_id=a.instance_id,
        instance_dir=ctx.instances_dir / a.instance_id,
        argv=tuple(argv),
        plugin_env=env,
        spec_env=spec_env,
        device_nodes=plan.device_nodes,
        user=s.engine_user,
        writable_paths=(str(plan.cache_dir),) if plan.cache_dir is not None else (),
        readable_paths=(str(pkg.model_dir),) if pkg is not None else (),
        limits=limits,
        cgroup_parent=f"{s.cgroup_parent}/{ctx.node}",
        sandbox=ctx.sandbox,
        stop_grace_s=s.stop_grace_s,
    )
    names = tuple(sorted(build_env(os.environ, env, spec_env, ctx.sandbox)))
    return Prepared(sup, plan, names, note, port)
