"""Every flag a launch plan can emit exists in a pinned real SGLang release.

The test fetches the pinned `sglang` wheel once with `pip download --no-deps` (into the git-ignored
`.cache/sglang-wheel/`; PyPI is reachable here and in CI), checks its sha256, and reads
`sglang/srt/server_args.py` straight from the zip: nothing is installed and torch is never needed. The
argparse `add_argument("--...")` names are SGLang's flags; where a flag's `choices=` is a literal list or
a module-level list, the values we pass must be among them. A renamed or invented flag fails here.
"""

from __future__ import annotations

import ast
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from node_agent.executor.launch_plan import (
    CUSTOM_ATTRIBUTE_FLAGS,
    SGLANG_DTYPES,
    SGLANG_QUANTIZATIONS,
    EngineRequest,
    LaunchSettings,
    build_launch_plan,
)
from node_agent.vendors import VENDORS

SGLANG_VERSION = "0.5.10.post1"  # the newest release with a pure-Python (py3-none-any) wheel
WHEEL = f"sglang-{SGLANG_VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "a854a68b11caf6b4b55c241a44378a7cdede7ede325db85c955f131506703bc6"
CACHE = Path(__file__).resolve().parents[1] / ".cache" / "sglang-wheel"


@pytest.fixture(scope="module")
def server_args() -> str:
    wheel = CACHE / WHEEL
    if not wheel.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                f"sglang=={SGLANG_VERSION}",
                "--no-deps",
                "--only-binary=:all:",
                "--platform",
                "any",
                "--python-version",
                "3.11",
                "--implementation",
                "py",
                "--abi",
                "none",
                "--dest",
                str(CACHE),
            ],
            check=True,
            capture_output=True,
            timeout=300,
        )
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert digest == WHEEL_SHA256, (
        f"{wheel}: sha256 {digest}, pinned {WHEEL_SHA256}; delete it to fetch again"
    )
    with zipfile.ZipFile(wheel) as z:
        return z.read("sglang/srt/server_args.py").decode("utf-8")


def argparse_flags(source: str) -> dict[str, list[str] | None]:
    """Every `--flag` of `add_argument` calls -> its choices (None when not a list we can read)."""
    tree = ast.parse(source)
    lists: dict[str, list[str]] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            if isinstance(stmt.value, ast.List | ast.Tuple):
                values = [e.value for e in stmt.value.elts if isinstance(e, ast.Constant)]
                lists[stmt.targets[0].id] = [str(v) for v in values]
    flags: dict[str, list[str] | None] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr != "add_argument":
            continue
        choices: list[str] | None = None
        for keyword in node.keywords:
            if keyword.arg != "choices":
                continue
            if isinstance(keyword.value, ast.List | ast.Tuple):
                choices = [str(e.value) for e in keyword.value.elts if isinstance(e, ast.Constant)]
            elif isinstance(keyword.value, ast.Name):
                choices = lists.get(keyword.value.id)
        for arg in node.args:
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("--"):
                flags[arg.value] = choices
    return flags


def every_plan_argv(flags: dict[str, list[str] | None]) -> list[tuple[str, list[str]]]:
    """The SGLang command line of every vendor SGLang runs on, with every option the platform can set
    (string attributes take a value SGLang accepts: they are the user's words, only their flag is ours)."""
    attributes: dict[str, object] = {}
    for key, (flag, kind) in CUSTOM_ATTRIBUTE_FLAGS.items():
        if kind is str:
            attributes[key] = (flags.get(flag) or ["x"])[0]
        else:
            attributes[key] = True if kind is bool else (0.5 if kind is float else 1)
    out = []
    for name, record in VENDORS.items():
        if record.sglang_refusal:
            continue
        req = EngineRequest(
            workload_name="w",
            model="/models/m",
            engine="sglang",
            command_template=None,
            quantization="fp8",
            dtype="bfloat16",
            tp_size=1,
            device_type=name,
            device_model="x",
            envs={record.runtime.visible_env: "0"},
            device_nodes=(),
            engine_hints=record.runtime.sglang_args,
            custom_attributes=attributes,
            host="127.0.0.1",
            port=30000,
        )
        out.append((name, list(build_launch_plan(req, LaunchSettings()).argv)))
    return out


def unknown(argv: list[str], flags: dict[str, list[str] | None]) -> list[str]:
    """Flags of `argv` SGLang does not define, and `--flag value` pairs whose value is not a choice."""
    bad = []
    for i, token in enumerate(argv):
        if not token.startswith("--"):
            continue
        flag = token.partition("=")[0]
        if flag not in flags:
            bad.append(flag)
            continue
        choices = flags[flag]
        value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
        if choices is not None and value is not None and value not in choices:
            bad.append(f"{flag} {value}")
    return bad


def test_every_emitted_flag_exists_in_sglang(server_args: str) -> None:
    flags = argparse_flags(server_args)
    assert len(flags) > 100  # the parse found SGLang's arguments, not an empty file
    plans = every_plan_argv(flags)
    assert {name for name, _ in plans} >= {"ascend", "cambricon", "hygon", "nvidia"}
    for name, argv in plans:
        assert unknown(argv, flags) == [], (name, argv)
    for _, record in VENDORS.items():
        assert unknown(list(record.runtime.sglang_args), flags) == [], record.type_name


def test_quantizations_and_dtypes_are_sglang_choices(server_args: str) -> None:
    flags = argparse_flags(server_args)
    quantizations, dtypes = flags["--quantization"], flags["--dtype"]
    assert quantizations is not None and dtypes is not None
    assert sorted(SGLANG_QUANTIZATIONS - set(quantizations)) == []
    assert sorted(SGLANG_DTYPES - set(dtypes)) == []


def test_an_invented_or_renamed_flag_is_caught(server_args: str) -> None:
    flags = argparse_flags(server_args)
    _, argv = every_plan_argv(flags)[0]
    assert unknown([*argv, "--tensor-parallel", "2", "--attention-backend", "npu-fast"], flags) == [
        "--tensor-parallel",
        "--attention-backend npu-fast",
    ]
