"""From a workload, its allocation and the device plugin's answer, the exact engine process to start.

SGLang (`engine="sglang"`)::

    <python> -m sglang.launch_server --model-path M --served-model-name <workload> \\
        --host <node address> --port P --tp-size N [--dtype D] [--quantization Q] \\
        <vendor args> <plugin engine hints> <custom attribute options> <extra args>

Per vendor, the visibility variable (which must come from the plugin's allocate result), the SGLang
arguments, the compiler cache variables and the cache key fields come from the vendor's record
(`node_agent.vendors.<type>`, `VENDOR.runtime`). A vendor on which SGLang cannot run
(`kunlun_common.names.VendorName.sglang_refusal`) refuses `engine="sglang"` with that reason.

`quantization` must be one of SGLang's `--quantization` choices (see `SGLANG_QUANTIZATIONS`,
taken from SGLang's server arguments) and `dtype` one of `SGLANG_DTYPES`. Later sources
override earlier ones flag by flag (hints < custom attributes < extra args); the flags the
platform owns (model, name, host, port, tp size) cannot be overridden.

Custom attributes that map to engine options (others are ignored here, they belong to the
scheduler or gateway):

| attribute            | SGLang option            | type  |
|----------------------|--------------------------|-------|
| context_length       | --context-length         | int   |
| mem_fraction_static  | --mem-fraction-static    | float in (0, 1] |
| max_running_requests | --max-running-requests   | int   |
| max_total_tokens     | --max-total-tokens       | int   |
| max_prefill_tokens   | --max-prefill-tokens     | int   |
| chunked_prefill_size | --chunked-prefill-size   | int   |
| kv_cache_dtype       | --kv-cache-dtype         | str   |
| schedule_policy      | --schedule-policy        | str   |
| attention_backend    | --attention-backend      | str   |
| chat_template        | --chat-template          | str   |
| reasoning_parser     | --reasoning-parser       | str   |
| tool_call_parser     | --tool-call-parser       | str   |
| random_seed          | --random-seed            | int   |
| dp_size              | --dp-size                | int   |
| trust_remote_code    | --trust-remote-code      | bool (flag when true) |
| enable_metrics       | --enable-metrics         | bool  |
| disable_radix_cache  | --disable-radix-cache    | bool  |
| disable_cuda_graph   | --disable-cuda-graph     | bool  |
| enable_torch_compile | --enable-torch-compile   | bool  |

`engine="test"` runs the built-in test engine (`node_agent.testengine`: no weights, no accelerator
code; what `kunlun-cli verify` deploys) with the workload's engine_args appended.

Other engines (`engine="template"`) use `command_template`, split like a shell would (no shell
runs) with the placeholders `{model} {name} {host} {port} {tp_size} {dtype} {quantization}
{device_type} {device_model} {visible_devices} {cache_dir} {python}` filled per token; a token
that is exactly `{engine_hints}` or `{extra_args}` expands to those lists, and extra args not
placed that way are appended.

A compilation cache directory per node, keyed by the vendor's cache key fields (by default model,
engine version, device model), is passed through the environment: TORCHINDUCTOR_CACHE_DIR and
TRITON_CACHE_DIR for every engine, the vendor's own cache variables (CUDA_CACHE_PATH on NVIDIA,
MIOPEN_USER_DB_PATH / MIOPEN_CUSTOM_CACHE_DIR on Hygon...), and KUNLUN_CACHE_DIR. The caller creates the directory (and chowns it for an unprivileged engine).
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from kunlun_common.errors import ConfigError
from kunlun_common.names import DEVICE_TYPES
from node_agent.vendors import VendorRuntime, vendor

log = structlog.get_logger(__name__)

SGLANG_QUANTIZATIONS = frozenset(
    {
        "awq",
        "awq_marlin",
        "bitsandbytes",
        "compressed-tensors",
        "fp8",
        "gguf",
        "gptq",
        "gptq_marlin",
        "marlin",
        "modelopt",
        "modelopt_fp4",
        "modelopt_fp8",
        "modelslim",
        "moe_wna16",
        "mxfp4",
        "w4afp8",
        "w8a8_fp8",
        "w8a8_int8",
    }
)
TEST_ENGINE_MODULE = "node_agent.testengine"
"""The built-in test engine, run by `engine="test"`."""
SGLANG_DTYPES = frozenset({"auto", "half", "float16", "bfloat16", "float", "float32"})


COMMON_CACHE_ENV = (("TORCHINDUCTOR_CACHE_DIR", "torchinductor"), ("TRITON_CACHE_DIR", "triton"))
CUSTOM_ATTRIBUTE_FLAGS: Mapping[str, tuple[str, type]] = {
    "context_length": ("--context-length", int),
    "mem_fraction_static": ("--mem-fraction-static", float),
    "max_running_requests": ("--max-running-requests", int),
    "max_total_tokens": ("--max-total-tokens", int),
    "max_prefill_tokens": ("--max-prefill-tokens", int),
    "chunked_prefill_size": ("--chunked-prefill-size", int),
    "kv_cache_dtype": ("--kv-cache-dtype", str),
    "schedule_policy": ("--schedule-policy", str),
    "attention_backend": ("--attention-backend", str),
    "chat_template": ("--chat-template", str),
    "reasoning_parser": ("--reasoning-parser", str),
    "tool_call_parser": ("--tool-call-parser", str),
    "random_seed": ("--random-seed", int),
    "dp_size": ("--dp-size", int),
    "trust_remote_code": ("--trust-remote-code", bool),
    "enable_metrics": ("--enable-metrics", bool),
    "disable_radix_cache": ("--disable-radix-cache", bool),
    "disable_cuda_graph": ("--disable-cuda-graph", bool),
    "enable_torch_compile": ("--enable-torch-compile", bool),
}
RESERVED_FLAGS = frozenset(
    {
        "--model-path",
        "--model",
        "--served-model-name",
        "--host",
        "--port",
        "--tp-size",
        "--tp",
        "--tensor-parallel-size",
    }
)
TEMPLATE_PLACEHOLDERS = frozenset(
    {
        "model",
        "name",
        "host",
        "port",
        "tp_size",
        "dtype",
        "quantization",
        "device_type",
        "device_model",
        "visible_devices",
        "cache_dir",
        "python",
    }
)


@dataclass(frozen=True)
class EngineRequest:
    """Everything the plan is built from (workload spec, allocation, plugin allocate result)."""

    workload_name: str
    """Workload name; served as the model name clients ask for."""
    model: str
    """Model path or hub id."""
    engine: str
    """"sglang", "template" or "test"."""
    command_template: str | None
    """Command line with placeholders, for engine="template"."""
    quantization: str | None
    """SGLang --quantization value, or None for the checkpoint's own."""
    dtype: str | None
    """SGLang --dtype value, or None for auto."""
    tp_size: int
    """Tensor parallel size (number of devices)."""
    device_type: str
    """ascend, cambricon, hygon or nvidia."""
    device_model: str
    """Device model (e.g. 910B3), part of the compilation cache key."""
    envs: Mapping[str, str]
    """Environment returned by the device plugin's allocate (e.g. ASCEND_RT_VISIBLE_DEVICES=0,1)."""
    device_nodes: Sequence[str]
    """Device nodes returned by the device plugin's allocate."""
    engine_hints: Sequence[str]
    """Extra engine arguments suggested by the device plugin."""
    custom_attributes: Mapping[str, object]
    """Workload custom attributes; those in CUSTOM_ATTRIBUTE_FLAGS become engine options."""
    host: str
    """Address of this node the engine listens on."""
    port: int
    """Port the engine listens on."""
    extra_args: Sequence[str] = ()
    """Extra engine arguments from the workload spec (last word on every non-reserved flag)."""


@dataclass(frozen=True)
class LaunchSettings:
    """Node-level settings for building launch plans."""

    python: str = "python3"
    """Interpreter of the engine's Python environment."""
    engine_version: str = "unknown"
    """Engine version on this node, part of the compilation cache key."""
    cache_root: Path | None = None
    """Root of the compilation caches on this node; None disables the cache directory."""


@dataclass(frozen=True)
class LaunchPlan:
    """The exact engine process."""

    argv: tuple[str, ...]
    """Command line."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables the engine needs on top of the sandbox's allowlisted environment."""
    device_nodes: tuple[str, ...] = ()
    """Device nodes to expose in the sandbox's private /dev."""
    cache_dir: Path | None = None
    """Compilation cache directory for this (model, engine version, device model)."""


def _slug(text: str, limit: int) -> str:
    slug = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.")[:limit].strip("-.")
    return slug or "x"


def cache_dir_for(root: Path, model: str, engine_version: str, device_model: str) -> Path:
    """A safe, stable cache directory under `root` for (model, engine version, device model).

    The name is readable slugs plus a hash of the exact triple, so different triples never share
    a directory and no input can escape `root`.
    """
    return cache_dir_for_key(
        root, {"model": model, "engine_version": engine_version, "device_model": device_model}
    )


CACHE_KEY_FIELDS = frozenset({"model", "engine_version", "device_model", "device_type", "tp_size", "dtype"})


def cache_key(req: EngineRequest, settings: LaunchSettings, runtime: VendorRuntime) -> dict[str, str]:
    """The values of the vendor's cache key fields (`VendorRuntime.cache_key`) for this request."""
    values = {
        "model": req.model,
        "engine_version": settings.engine_version,
        "device_model": req.device_model,
        "device_type": req.device_type,
        "tp_size": str(req.tp_size),
        "dtype": req.dtype or "",
    }
    unknown = [f for f in runtime.cache_key if f not in CACHE_KEY_FIELDS]
    if unknown:
        raise ConfigError(
            f"{req.device_type}: unknown cache key field(s) {unknown}; use {sorted(CACHE_KEY_FIELDS)}"
        )
    return {f: values[f] for f in runtime.cache_key}


def cache_dir_for_key(root: Path, key: Mapping[str, str]) -> Path:
    """A safe, stable cache directory under `root` for the key (field -> value, in the vendor's order).

    The name is readable slugs of the model, device model and engine version (when in the key) plus a
    hash of every value in order, so different keys never share a directory and no input can escape `root`.
    """
    digest = hashlib.sha256(json.dumps(list(key.values())).encode()).hexdigest()[:16]
    slugs = [
        _slug(key[f], limit)
        for f, limit in (("model", 48), ("device_model", 24), ("engine_version", 24))
        if f in key
    ]
    return root / "--".join([*slugs, digest])


Options = dict[str, tuple[str, ...]]


def _parse_options(tokens: Sequence[str], source: str) -> Options:
    """Parse `--flag`, `--flag value...` and `--flag=value` tokens into an ordered mapping."""
    opts: Options = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--"):
            raise ConfigError(f"{source}: unexpected argument {token!r}; expected --option [value]")
        flag, eq, value = token.partition("=")
        i += 1
        values: list[str] = [value] if eq else []
        while not eq and i < len(tokens) and not tokens[i].startswith("--"):
            values.append(tokens[i])
            i += 1
        if flag in RESERVED_FLAGS:
            raise ConfigError(f"{source}: {flag} is set by the platform and cannot be overridden")
        opts[flag] = tuple(values)
    return opts


def _custom_options(attributes: Mapping[str, object]) -> Options:
    opts: Options = {}
    for key, value in attributes.items():
        if key not in CUSTOM_ATTRIBUTE_FLAGS:
            log.debug("launch_plan.attribute_ignored", attribute=key)
            continue
        flag, kind = CUSTOM_ATTRIBUTE_FLAGS[key]
        where = f"custom_attributes.{key}"
        if kind is bool:
            if not isinstance(value, bool):
                raise ConfigError(f"{where} must be true or false, got {value!r}")
            if value:
                opts[flag] = ()
            continue
        if isinstance(value, bool) or not (
            isinstance(value, kind) or (kind is float and isinstance(value, int))
        ):
            raise ConfigError(f"{where} must be a {kind.__name__}, got {value!r}")
        if key == "mem_fraction_static" and isinstance(value, int | float) and not 0 < value <= 1:
            raise ConfigError(f"{where} must be in (0, 1], got {value!r}")
        opts[flag] = (str(value),)
    return opts


def _flatten(opts: Options) -> list[str]:
    return [token for flag, values in opts.items() for token in (flag, *values)]


def _visible_devices(req: EngineRequest, vendor: VendorRuntime) -> str:
    visible = req.envs.get(vendor.visible_env)
    if not visible:
        raise ConfigError(
            f"device plugin for {req.device_type} returned no {vendor.visible_env}; "
            "the engine would see every device on the node"
        )
    count = len([d for d in visible.split(",") if d.strip()])
    if count < req.tp_size:
        raise ConfigError(
            f"tp_size {req.tp_size} needs {req.tp_size} devices, {vendor.visible_env}={visible}"
        )
    return visible


def _cache_env(req: EngineRequest, vendor: VendorRuntime, cache_dir: Path | None) -> dict[str, str]:
    if cache_dir is None:
        return {}
    env = {"KUNLUN_CACHE_DIR": str(cache_dir)}
    for var, sub in (*COMMON_CACHE_ENV, *vendor.cache_env):
        env[var] = str(cache_dir / sub)
    return env


def _sglang_argv(req: EngineRequest, vendor: VendorRuntime, settings: LaunchSettings) -> list[str]:
    argv = [
        settings.python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        req.model,
        "--served-model-name",
        req.workload_name,
        "--host",
        req.host,
        "--port",
        str(req.port),
        "--tp-size",
        str(req.tp_size),
    ]
    opts: Options = {}
    if req.dtype:
        if req.dtype not in SGLANG_DTYPES:
            raise ConfigError(f"dtype {req.dtype!r} is not one of {sorted(SGLANG_DTYPES)}")
        opts["--dtype"] = (req.dtype,)
    if req.quantization:
        if req.quantization not in SGLANG_QUANTIZATIONS:
            raise ConfigError(
                f"quantization {req.quantization!r} is not an SGLang method; use one of "
                f"{sorted(SGLANG_QUANTIZATIONS)}"
            )
        opts["--quantization"] = (req.quantization,)
    opts.update(_parse_options(vendor.sglang_args, "vendor arguments"))
    opts.update(_parse_options(req.engine_hints, "device plugin engine hints"))
    opts.update(_custom_options(req.custom_attributes))
    opts.update(_parse_options(req.extra_args, "extra_args"))
    return argv + _flatten(opts)


def _template_argv(req: EngineRequest, values: Mapping[str, object]) -> list[str]:
    if not req.command_template:
        raise ConfigError(f"workload {req.workload_name}: engine 'template' needs a command_template")
    try:
        tokens = shlex.split(req.command_template)
    except ValueError as exc:
        raise ConfigError(f"command_template: {exc}") from exc
    argv: list[str] = []
    extra_placed = False
    for token in tokens:
        if token == "{engine_hints}":
            argv.extend(req.engine_hints)
            continue
        if token == "{extra_args}":
            argv.extend(req.extra_args)
            extra_placed = True
            continue
        for _, name, _, _ in string.Formatter().parse(token):
            if name is None:
                continue
            if name not in TEMPLATE_PLACEHOLDERS:
                raise ConfigError(
                    f"command_template: unknown placeholder {{{name}}}; use {sorted(TEMPLATE_PLACEHOLDERS)}"
                )
            if values[name] is None:
                raise ConfigError(f"command_template uses {{{name}}} but the workload sets no {name}")
        try:
            argv.append(token.format(**values))
        except (ValueError, IndexError, KeyError) as exc:
            raise ConfigError(f"command_template: cannot fill {token!r}: {exc}") from exc
    if not extra_placed:
        argv.extend(req.extra_args)
    if not argv:
        raise ConfigError("command_template is empty")
    return argv


def build_launch_plan(req: EngineRequest, settings: LaunchSettings) -> LaunchPlan:
    """Build the engine command line and environment; raise ConfigError on an invalid request."""
    if req.device_type not in DEVICE_TYPES:
        raise ConfigError(f"device_type {req.device_type!r} is not one of {list(DEVICE_TYPES)}")
    if req.tp_size < 1:
        raise ConfigError(f"tp_size must be at least 1, got {req.tp_size}")
    record = vendor(req.device_type)
    runtime = record.runtime
    visible = _visible_devices(req, runtime)
    cache_dir = None
    if settings.cache_root is not None:
        cache_dir = cache_dir_for_key(settings.cache_root, cache_key(req, settings, runtime))
    if req.engine == "sglang" and record.sglang_refusal:
        raise ConfigError(
            f"engine 'sglang' cannot run on {req.device_type}: {record.sglang_refusal}; "
            "use engine 'template' with a command_template for this vendor's own engine"
        )
    if req.engine == "sglang":
        argv = _sglang_argv(req, runtime, settings)
    elif req.engine == "template":
        values: dict[str, object] = {
            "model": req.model,
            "name": req.workload_name,
            "host": req.host,
            "port": req.port,
            "tp_size": req.tp_size,
            "dtype": req.dtype,
            "quantization": req.quantization,
            "device_type": req.device_type,
            "device_model": req.device_model,
            "visible_devices": visible,
            "cache_dir": str(cache_dir) if cache_dir else None,
            "python": settings.python,
        }
        argv = _template_argv(req, values)
    elif req.engine == "test":  # the built-in test engine (`kunlun-cli verify`); prepare.py runs it
        argv = [
            settings.python,
            "-m",
            TEST_ENGINE_MODULE,
            "--host",
            req.host,
            "--port",
            str(req.port),
            "--served-model-name",
            req.workload_name,
            *req.extra_args,
        ]
    else:
        raise ConfigError(f"engine {req.engine!r} is not supported; use 'sglang', 'template' or 'test'")
    env = {**req.envs, **_cache_env(req, runtime, cache_dir)}
    return LaunchPlan(tuple(argv), env, tuple(dict.fromkeys(req.device_nodes)), cache_dir)
