"""Secrets in specs are for operators: env values and secret engine arguments are redacted for
every other role, and engine logs need the operator role."""

from __future__ import annotations

from controlplane.api.auth import PERMISSIONS
from controlplane.redact import REDACTED, instances_for, redact_args, workload_for
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


def _instances(w: workload_pb2.Workload) -> list[workload_pb2.Instance]:
    """One instance placed with the workload's current spec, one with an older one (a rolling update)."""
    current = workload_pb2.Instance(
        id="w-1-0-5", spec=w.spec, launch_command=["engine", "--api-key", "sk-live-123"]
    )
    current.spec.replicas = 0
    old = workload_pb2.Instance(id="w-1-1-3", spec=w.spec)
    old.spec.env["HF_TOKEN"] = "hf_old_secret"
    return [current, old]


def test_instances_carry_no_repeated_spec_and_no_secret_for_viewers() -> None:
    w = _workload()
    w.spec.replicas = 2
    current, old = instances_for(Identity("viewer", "viewer"), w, _instances(w))
    assert not current.HasField("spec"), "the workload's current spec travels once, in the workload"
    assert list(current.launch_command) == ["engine", "--api-key", REDACTED]
    assert dict(old.spec.env) == {"HF_TOKEN": REDACTED, "LOG_LEVEL": REDACTED}
    assert "sk-live-123" not in list(old.spec.engine_args)
    current, old = instances_for(Identity("admin", "operator"), w, _instances(w))
    assert not current.HasField("spec") and "sk-live-123" in list(current.launch_command)
    assert old.spec.env["HF_TOKEN"] == "hf_old_secret"
