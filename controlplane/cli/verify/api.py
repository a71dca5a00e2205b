"""The verify run's calls to the replicas (gRPC with the operator certificate, failing over like every
other command), the things it creates (tracked so they are removed again), and polling helpers.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from controlplane.cli.client import Client, CliError
from kunlun_common.api import (
    agent_pb2,
    agent_pb2_grpc,
    cluster_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    telemetry_pb2,
    types_pb2,
    workload_pb2,
)
from kunlun_common.i18n import _, localize
from kunlun_common.messages import Message, msg, plain

NAME_PREFIX = "kunlun-verify-"
"""Every workload a run creates is named `kunlun-verify-<run>-<what>`."""
TOOL_TIMEOUT_S = 40.0


@dataclass
class Api:
    """One run's view of the cluster; `created` lists what must be removed at the end."""

    client: Client
    run_id: str = field(default_factory=lambda: secrets.token_hex(3))
    created_workloads: list[str] = field(default_factory=list)
    created_keys: list[str] = field(default_factory=list)

    # ------------------------------------------------------------------------------------- reads
    def devices(self) -> list[types_pb2.Device]:
        return self.client.cluster_pages(lambda s: s.ListDevices, cluster_pb2.ListDevicesRequest(), "devices")

    def nodes(self) -> list[types_pb2.Node]:
        return self.client.cluster_pages(lambda s: s.ListNodes, cluster_pb2.ListNodesRequest(), "nodes")

    def metrics(self, flt: str = "") -> list[telemetry_pb2.DeviceMetric]:
        from controlplane.cli.telemetry_cmd import fetch_metrics

        return list(fetch_metrics(self.client, flt).devices)

    def tool_reading(self, node: str) -> agent_pb2.ToolReadingResponse:
        """Every vendor tool of `node`, run now by its agent (a tool may take seconds: longer timeout)."""
        slow = Client(self.client.cfg, timeout_s=max(self.client.timeout_s, TOOL_TIMEOUT_S))
        resp: agent_pb2.ToolReadingResponse = slow.call_stub(
            agent_pb2_grpc.LedgerServiceStub,
            lambda s: s.NodeToolReading,
            agent_pb2.ToolReadingRequest(node=node),
        )
        return resp

    def workloads(self) -> list[workload_pb2.WorkloadSummary]:
        return self.client.all_workloads()

    def workload(self, name: str) -> workload_pb2.WorkloadSummary:
        resp: workload_pb2.WorkloadSummary = self.client.workloads(
            lambda s: s.GetWorkload, workload_pb2.GetWorkloadRequest(name=name)
        )
        return resp

    def gateways(self) -> list[gateway_pb2.GatewayInfo]:
        found: list[gateway_pb2.GatewayInfo] = self.client.pages(
            gateway_pb2_grpc.GatewayServiceStub,
            lambda s: s.ListGateways,
            gateway_pb2.ListGatewaysRequest(),
            "gateways",
        )
        return sorted(found, key=lambda g: g.name)

    def leader(self) -> str:
        resp: cluster_pb2.ClusterStatusResponse = self.client.call(
            lambda s: s.ClusterStatus, cluster_pb2.ClusterStatusRequest()
        )
        return resp.leader

    def rollout(self, workload: str, live: bool = False) -> rollout_pb2.Rollout:
        """The workload's rollout; with `live` also analysed now (`live_analysis`)."""
        resp: rollout_pb2.Rollout = self.client.call_stub(
            rollout_pb2_grpc.RolloutServiceStub,
            lambda s: s.GetRollout,
            rollout_pb2.RolloutRequest(workload=workload, live_analysis=live),
        )
        return resp

    # ------------------------------------------------------------------------------------ writes
    def create_rollout(self, spec: rollout_pb2.RolloutSpec) -> rollout_pb2.Rollout:
        """A rollout of one of the run's workloads (it goes when the workload is deleted)."""
        if spec.workload not in self.created_workloads:
            raise CliError(
                _("internal: verify rolls out only its own workloads, found {name}").format(
                    name=spec.workload
                )
            )
        resp: rollout_pb2.Rollout = self.client.call_stub(
            rollout_pb2_grpc.RolloutServiceStub,
            lambda s: s.CreateRollout,
            rollout_pb2.CreateRolloutRequest(spec=spec),
        )
        return resp

    def promote(self, workload: str) -> rollout_pb2.Rollout:
        resp: rollout_pb2.Rollout = self.client.call_stub(
            rollout_pb2_grpc.RolloutServiceStub,
            lambda s: s.PromoteRollout,
            rollout_pb2.RolloutRequest(workload=workload),
        )
        return resp

    def name(self, what: str) -> str:
        return f"{NAME_PREFIX}{self.run_id}-{what}"

    def submit(self, spec: workload_pb2.WorkloadSpec) -> workload_pb2.Workload:
        """Create a test workload (its name must start with NAME_PREFIX); remembered for cleanup."""
        if not spec.name.startswith(NAME_PREFIX):
            raise CliError(
                _("internal: verify workload names start with {name_prefix}, found {name}").format(
                    name_prefix=NAME_PREFIX, name=spec.name
                )
            )
        if spec.name not in self.created_workloads:
            self.created_workloads.append(spec.name)  # before the call: an answer lost on the way
        resp: workload_pb2.SubmitWorkloadResponse = self.client.workloads(
            lambda s: s.SubmitWorkload, workload_pb2.SubmitWorkloadRequest(spec=spec)
        )
        return resp.workload

    def api_key(self) -> str:
        """A gateway API key of the run's own (only made when a gateway asked for one)."""
        resp: gateway_pb2.CreateApiKeyResponse = self.client.call_stub(
            gateway_pb2_grpc.GatewayServiceStub,
            lambda s: s.CreateApiKey,
            gateway_pb2.CreateApiKeyRequest(name=self.name("key")),
        )
        self.created_keys.append(resp.key.id)
        return resp.secret

    def cleanup(self, timeout_s: float = 60.0) -> list[Message]:
        """Remove every workload and key of the run; one line per thing (says so when one stayed)."""
        lines: list[Message] = []
        for key_id in self.created_keys:
            try:
                self.client.call_stub(
                    gateway_pb2_grpc.GatewayServiceStub,
                    lambda s: s.RevokeApiKey,
                    gateway_pb2.RevokeApiKeyRequest(id=key_id),
                )
                lines.append(msg("verify.cleanup.key_revoked", "api key {key_id} revoked", key_id=key_id))
            except CliError as e:
                lines.append(
                    msg(
                        "verify.cleanup.key_not_removed",
                        "api key {key_id} NOT removed: {e}",
                        key_id=key_id,
                        e=plain(str(e)),
                    )
                )
        for name in self.created_workloads:
            try:
                self.client.workloads(
                    lambda s: s.DeleteWorkload, workload_pb2.DeleteWorkloadRequest(name=name)
                )
            except CliError as e:
                if "not found" not in str(e):
                    lines.append(
                        msg(
                            "verify.cleanup.workload_not_removed",
                            "workload {name} NOT removed: {e}",
                            name=name,
                            e=plain(str(e)),
                        )
                    )
                    continue
        deadline = time.monotonic() + timeout_s
        pending = list(self.created_workloads)
        while pending and time.monotonic() < deadline:
            present = {w.workload.spec.name for w in self.workloads()}
            for name in [n for n in pending if n not in present]:
                lines.append(msg("verify.cleanup.workload_deleted", "workload {name} deleted", name=name))
                pending.remove(name)
            if pending:
                time.sleep(0.5)
        lines.extend(
            msg(
                "verify.cleanup.workload_still_deleting",
                "workload {name} NOT removed within {timeout_s:.0f} s (still deleting)",
                name=n,
                timeout_s=timeout_s,
            )
            for n in pending
        )
        self.created_workloads, self.created_keys = [], []
        return lines


def test_workload(name: str, **kw: object) -> workload_pb2.WorkloadSpec:
    """A workload served by the built-in test engine."""
    spec = workload_pb2.WorkloadSpec(
        name=name,
        model=name,
        engine="test",  # the built-in test engine: no model weights, no accelerator code
        devices_per_instance=1,
        memory_per_device_mb=1024,
        replicas=1,
        priority="normal",
    )
    for k, v in kw.items():
        if isinstance(v, list):
            getattr(spec, k).extend(v)
        else:
            setattr(spec, k, v)
    return spec


def poll(what: Message, check: Callable[[], bool], timeout_s: float, interval_s: float = 0.5) -> float:
    """Wait until `check()` holds; return the seconds it took. CliError naming `what` on timeout."""
    started = time.monotonic()
    while True:
        if check():
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise CliError(
                _("timed out after {timeout_s:.0f} s waiting for {what}").format(
                    timeout_s=timeout_s, what=localize(what)
                )
            )
        time.sleep(interval_s)


def running(summary: workload_pb2.WorkloadSummary) -> list[workload_pb2.Instance]:
    return [i for i in summary.instances if i.phase == "Running" and i.endpoint]
