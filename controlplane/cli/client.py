"""Calling the replicas from the CLI: each endpoint in turn, so it works while any replica lives."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from controlplane.cli.config import ClientConfig
from kunlun_common.api import cluster_pb2_grpc, workload_pb2, workload_pb2_grpc
from kunlun_common.errors import KunlunError
from kunlun_common.pki import CertPaths
from kunlun_common.tls import TlsMaterial, channel_credentials, load_tls

T = TypeVar("T")
S = TypeVar("S")
_FAILOVER = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


class CliError(KunlunError):
    """One clear line for stderr."""


class Client:
    def __init__(self, cfg: ClientConfig, timeout_s: float = 5.0) -> None:
        from pathlib import Path

        self.cfg = cfg
        self.timeout_s = timeout_s
        replica_ca = Path(cfg.replica_ca) if cfg.replica_ca else None
        self.tls: TlsMaterial = load_tls(CertPaths(Path(cfg.ca), Path(cfg.cert), Path(cfg.key), replica_ca))
        self.creds = channel_credentials(self.tls)
        self.answered_by = ""

    def channel(self, endpoint: str) -> grpc.Channel:
        return grpc.secure_channel(endpoint, self.creds)

    def call(self, fn: Callable[[cluster_pb2_grpc.ClusterServiceStub], Callable[..., T]], request: Any) -> T:
        """Call a ClusterService method on the first replica that answers."""
        return self.call_stub(cluster_pb2_grpc.ClusterServiceStub, fn, request)

    def workloads(
        self, fn: Callable[[workload_pb2_grpc.WorkloadServiceStub], Callable[..., T]], request: Any
    ) -> T:
        """Call a WorkloadService method on the first replica that answers."""
        return self.call_stub(workload_pb2_grpc.WorkloadServiceStub, fn, request)

    def all_workloads(self, page_size: int = 500) -> list[workload_pb2.WorkloadSummary]:
        """Every workload, oldest first, fetched in pages read at one revision (a replica from
        before paging answers everything in its first reply, which ends the loop too)."""
        out: list[workload_pb2.WorkloadSummary] = []
        token = ""
        for _ in range(100_000):  # bounded: a page always moves forward
            resp = self.workloads(
                lambda s: s.ListWorkloads,
                workload_pb2.ListWorkloadsRequest(page_size=page_size, page_token=token),
            )
            out.extend(resp.workloads)
            token = resp.next_page_token
            if not token:
                break
        out.sort(key=lambda s: s.workload.created_at_unix_ms)
        return out

    def call_stub(
        self, stub_cls: Callable[[grpc.Channel], S], fn: Callable[[S], Callable[..., T]], request: Any
    ) -> T:
        """Call a method on the first replica that answers; fail over on unavailable or timeout."""
        errors: list[str] = []
        for ep in self.cfg.endpoints:
            with self.channel(ep) as ch:
                stub = stub_cls(ch)
                try:
                    result = fn(stub)(request, timeout=self.timeout_s)
                    self.answered_by = ep
                    return result
                except grpc.RpcError as e:
                    code = e.code()
                    detail = e.details() or code.name
                    if code in _FAILOVER:
                        errors.append(f"{ep}: {_short(detail)}")
                        continue
                    raise CliError(f"{ep}: {code.name.lower().replace('_', ' ')}: {detail}") from None
        raise CliError(
            "no replica answered (" + "; ".join(errors) + "); check that the cluster runs (`make demo`) "
            "and that the endpoints in your client config are right"
        )


def _short(detail: str) -> str:
    d = detail.replace("\n", " ")
    if "failed to connect to all addresses" in d or "Connection refused" in d:
        return "connection refused"
    if "Deadline Exceeded" in d:
        return "no answer within the deadline"
    return d[:160]
