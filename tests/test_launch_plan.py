"""Launch plans: whole SGLang command lines and environments per vendor, templates, cache dirs."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from kunlun_common.errors import ConfigError
from node_agent.executor.launch_plan import (
    EngineRequest,
    LaunchSettings,
    build_launch_plan,
    cache_dir_for,
)

CACHE_ROOT = Path("/var/lib/kunlun/cache")
SETTINGS = LaunchSettings(python="/opt/sglang/bin/python", engine_version="0.5.4", cache_root=CACHE_ROOT)


def request(device_type: str, envs: dict[str, str], **overrides: object) -> EngineRequest:
    base = EngineRequest(
        workload_name="qwen-chat",
        model="/models/Qwen2.5-7B-Instruct",
        engine="sglang",
        command_template=None,
        quantization=None,
        dtype=None,
        tp_size=2,
        device_type=device_type,
        device_model="model-x",
        envs=envs,
        device_nodes=(),
        engine_hints=(),
        custom_attributes={},
        host="10.0.0.5",
        port=30001,
        extra_args=(),
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


BASE_ARGV = [
    "/opt/sglang/bin/python",
    "-m",
    "sglang.launch_server",
    "--model-path",
    "/models/Qwen2.5-7B-Instruct",
    "--served-model-name",
    "qwen-chat",
    "--host",
    "10.0.0.5",
    "--port",
    "30001",
    "--tp-size",
    "2",
]


def cache_env(cache: Path, **vendor: str) -> dict[str, str]:
    env = {
        "KUNLUN_CACHE_DIR": str(cache),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "torchinductor"),
        "TRITON_CACHE_DIR": str(cache / "triton"),
    }
    env.update({k: str(cache / v) for k, v in vendor.items()})
    return env


def test_ascend_whole_command_line_and_env() -> None:
    req = request(
        "ascend",
        {"ASCEND_RT_VISIBLE_DEVICES": "0,1"},
        device_model="910B3",
        quantization="w8a8_int8",
        dtype="bfloat16",
        device_nodes=("/dev/davinci0", "/dev/davinci1", "/dev/davinci_manager", "/dev/davinci0"),
    )
    plan = build_launch_plan(req, SETTINGS)
    cache = cache_dir_for(CACHE_ROOT, req.model, "0.5.4", "910B3")
    assert list(plan.argv) == [
        *BASE_ARGV,
        "--dtype",
        "bfloat16",
        "--quantization",
        "w8a8_int8",
        "--device",
        "npu",
        "--attention-backend",
        "ascend",
    ]
    assert dict(plan.env) == {"ASCEND_RT_VISIBLE_DEVICES": "0,1", **cache_env(cache)}
    assert plan.device_nodes == ("/dev/davinci0", "/dev/davinci1", "/dev/davinci_manager")
    assert plan.cache_dir == cache


def test_nvidia_whole_command_line_and_env() -> None:
    req = request("nvidia", {"CUDA_VISIBLE_DEVICES": "2,3"}, device_model="H100-80G", quantization="fp8")
    plan = build_launch_plan(req, SETTINGS)
    cache = cache_dir_for(CACHE_ROOT, req.model, "0.5.4", "H100-80G")
    assert list(plan.argv) == [*BASE_ARGV, "--quantization", "fp8"]
    assert dict(plan.env) == {"CUDA_VISIBLE_DEVICES": "2,3", **cache_env(cache, CUDA_CACHE_PATH="cuda")}


def test_hygon_whole_command_line_and_env() -> None:
    req = request(
        "hygon",
        {"HIP_VISIBLE_DEVICES": "0,1", "HSA_FORCE_FINE_GRAIN_PCIE": "1"},
        device_model="K100_AI",
        dtype="float16",
        engine_hints=("--attention-backend", "triton"),
    )
    plan = build_launch_plan(req, SETTINGS)
    cache = cache_dir_for(CACHE_ROOT, req.model, "0.5.4", "K100_AI")
    assert list(plan.argv) == [*BASE_ARGV, "--dtype", "float16", "--attention-backend", "triton"]
    assert dict(plan.env) == {
        "HIP_VISIBLE_DEVICES": "0,1",
        "HSA_FORCE_FINE_GRAIN_PCIE": "1",
        **cache_env(cache, MIOPEN_USER_DB_PATH="miopen", MIOPEN_CUSTOM_CACHE_DIR="miopen"),
    }


def test_cambricon_whole_command_line_and_env() -> None:
    req = request("cambricon", {"MLU_VISIBLE_DEVICES": "4,5"}, device_model="MLU370-X8")
    plan = build_launch_plan(req, replace(SETTINGS, cache_root=None))
    assert list(plan.argv) == BASE_ARGV
    assert dict(plan.env) == {"MLU_VISIBLE_DEVICES": "4,5"}
    assert plan.cache_dir is None


def test_override_order_hints_custom_attributes_extra_args() -> None:
    req = request(
        "ascend",
        {"ASCEND_RT_VISIBLE_DEVICES": "0,1"},
        engine_hints=("--attention-backend=ascend", "--mem-fraction-static", "0.8", "--enable-metrics"),
        custom_attributes={
            "mem_fraction_static": 0.85,
            "context_length": 8192,
            "trust_remote_code": True,
            "disable_radix_cache": False,
            "team": "search",  # not an engine option: ignored
        },
        extra_args=("--context-length", "4096", "--lora-paths", "a=/l/a", "b=/l/b"),
    )
    plan = build_launch_plan(req, replace(SETTINGS, cache_root=None))
    assert list(plan.argv) == [
        *BASE_ARGV,
        "--device",
        "npu",
        "--attention-backend",
        "ascend",
        "--mem-fraction-static",
        "0.85",
        "--enable-metrics",
        "--context-length",
        "4096",
        "--trust-remote-code",
        "--lora-paths",
        "a=/l/a",
        "b=/l/b",
    ]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"quantization": "int3"}, "not an SGLang method"),
        ({"dtype": "fp64"}, "dtype"),
        ({"extra_args": ("--port", "1")}, "set by the platform"),
        ({"engine_hints": ("--tp", "8")}, "set by the platform"),
        ({"extra_args": ("stray",)}, "unexpected argument"),
        ({"custom_attributes": {"context_length": "long"}}, "must be a int"),
        ({"custom_attributes": {"trust_remote_code": "yes"}}, "true or false"),
        ({"custom_attributes": {"mem_fraction_static": 1.5}}, "(0, 1]"),
        ({"tp_size": 4}, "needs 4 devices"),
        ({"envs": {}}, "returned no ASCEND_RT_VISIBLE_DEVICES"),
        ({"device_type": "tpu"}, "device_type"),
        ({"engine": "vllm"}, "not supported"),
    ],
)
def test_invalid_requests_are_config_errors(overrides: dict[str, object], message: str) -> None:
    req = replace(request("ascend", {"ASCEND_RT_VISIBLE_DEVICES": "0,1"}), **overrides)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_launch_plan(req, SETTINGS)


def test_template_engine_fills_placeholders_per_token() -> None:
    req = request(
        "nvidia",
        {"CUDA_VISIBLE_DEVICES": "0,1"},
        engine="template",
        command_template=(
            "{python} -m node_agent.testengine --model-path '{model}' --served-model-name {name} "
            "--host {host} --port {port} --tp-size {tp_size} {engine_hints} --cache '{cache_dir}' "
            "--devices={visible_devices}"
        ),
        engine_hints=("--latency-ms", "5"),
        extra_args=("--error-rate", "0.1"),
        model="/models/my model",
    )
    plan = build_launch_plan(req, SETTINGS)
    cache = cache_dir_for(CACHE_ROOT, "/models/my model", "0.5.4", "model-x")
    assert list(plan.argv) == [
        "/opt/sglang/bin/python",
        "-m",
        "node_agent.testengine",
        "--model-path",
        "/models/my model",
        "--served-model-name",
        "qwen-chat",
        "--host",
        "10.0.0.5",
        "--port",
        "30001",
        "--tp-size",
        "2",
        "--latency-ms",
        "5",
        "--cache",
        str(cache),
        "--devices=0,1",
        "--error-rate",
        "0.1",
    ]
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "0,1"


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (None, "needs a command_template"),
        ("serve {model} {secret}", "unknown placeholder"),
        ("serve {quantization}", "sets no quantization"),
        ("serve 'unterminated", "command_template"),
    ],
)
def test_template_errors(template: str | None, message: str) -> None:
    req = request("nvidia", {"CUDA_VISIBLE_DEVICES": "0,1"}, engine="template", command_template=template)
    with pytest.raises(ConfigError, match=message):
        build_launch_plan(req, SETTINGS)


def test_cache_dir_is_safe_stable_and_distinct(tmp_path: Path) -> None:
    a = cache_dir_for(tmp_path, "Qwen/Qwen2.5-7B-Instruct", "0.5.4", "910B3")
    assert a == cache_dir_for(tmp_path, "Qwen/Qwen2.5-7B-Instruct", "0.5.4", "910B3")
    assert a.parent == tmp_path
    assert a.name.startswith("qwen-qwen2.5-7b-instruct--910b3--0.5.4--")
    others = {
        cache_dir_for(tmp_path, "Qwen/Qwen2.5-7B-Instruct", "0.5.5", "910B3"),
        cache_dir_for(tmp_path, "Qwen/Qwen2.5-7B-Instruct", "0.5.4", "910B4"),
        cache_dir_for(tmp_path, "qwen/qwen2.5-7b-instruct", "0.5.4", "910B3"),  # same slug, other model
    }
    assert a not in others and len(others) == 3
    hostile = cache_dir_for(tmp_path, "../../etc", "../..", "/dev/null")
    assert hostile.parent == tmp_path
    assert ".." not in hostile.name.split("--")[0] and "/" not in hostile.name
    assert all(c.isalnum() or c in "._-" for c in hostile.name)
