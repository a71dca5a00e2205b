"""Secrets in specs are for operators: env values and secret engine arguments are redacted for
every other role, and engine logs need the operator role."""

from __future__ import annotations

from controlplane.api.auth import PERMISSIONS
from controlplane.redact import REDACTED, redact_args, workload_for
from kunlun_common.api import workload_pb2
from kunlun_common.tls import Identity


def _workload() -> workload_pb2.Workload:
    w = workload_pb2.Workload(id="w-1")
    w.spec.name = "chat"
    w.spec.env["HF_TOKEN"] = "hf_secret_value"
    w.spec.env["LOG_LEVEL"] = "debug"
    w.spec.engine_args.extend(
        ["--api-key", "sk-live-123", "--tp-size", "2", "--admin-token=abc", "--dtype", "bf16"]
    )
    return w


def test_viewer_sees_no_env_values_or_secret_arguments() -> None:
    w = workload_for(Identity("viewer", "viewer"), _workload())
    assert dict(w.spec.env) == {"HF_TOKEN": REDACTED, "LOG_LEVEL": REDACTED}
    assert list(w.spec.engine_args) == [
        "--api-key",
        REDACTED,
        "--tp-size",
        "2",
        f"--admin-token={REDACTED}",
        "--dtype",
        "bf16",
    ]
    text = str(w)
    assert "sk-live-123" not in text and "hf_secret_value" not in text and "abc" not in text


def test_operator_sees_the_spec_and_the_stored_record_is_untouched() -> None:
    original = _workload()
    assert workload_for(Identity("admin", "operator"), original) == original
    workload_for(Identity("viewer", "viewer"), original)
    assert original.spec.env["HF_TOKEN"] == "hf_secret_value"


def test_plain_arguments_are_kept() -> None:
    assert redact_args(["--model", "m", "--keyframes", "3"]) == ["--model", "m", "--keyframes", REDACTED]
    assert redact_args(["--port", "8000"]) == ["--port", "8000"]


def test_engine_logs_need_the_operator_role() -> None:
    assert PERMISSIONS["/kunlun.v1.WorkloadService/Logs"] == ("operator",)
