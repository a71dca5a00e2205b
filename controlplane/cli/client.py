"""Calling the replicas from the CLI: each endpoint in turn, so it works while any replica lives."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from controlplane.cli.config import ClientConfig
from kunlun_common.api import cluster_pb2_grpc, workload_pb2, workload_pb2_grpc
from kunlun_common.errors import KunlunError
from kunlun_common.i18n import _, localize
from kunlun_common.messages import from_metadata
from kunlun_common.pki import ETCD_CRL, CertPaths
from kunlun_common.server_check import presented_certificate, serial_hex, serials_in_crl
from kunlun_common.tls import TlsMaterial, channel_credentials, load_tls

T = TypeVar("T")
S = TypeVar("S")
_FAILOVER = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
PAGE_SIZE = 500
"""Items the CLI asks for per page of a List call (a replica also cuts a page at 1 MiB)."""


class CliError(KunlunError):
    """One clear line for stderr."""


class RefusedReplica(grpc.RpcError):
    """A replica refused before calling it (its certificate is revoked): try the next one."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self.detail

    def trailing_metadata(self) -> tuple[()]:
        return ()


class Client:
    def __init__(self, cfg: ClientConfig, timeout_s: float = 5.0) -> None:
        from pathlib import Path

        self.cfg = cfg
        self.timeout_s = timeout_s
        replica_ca = Path(cfg.replica_ca) if cfg.replica_ca else None
        self.tls: TlsMaterial = load_tls(CertPaths(Path(cfg.ca), Path(cfg.cert), Path(cfg.key), replica_ca))
        self.creds = channel_credentials(self.tls)
        self.answered_by = ""
        self.revoked = self._revocation_list()

    def _revocation_list(self) -> frozenset[str] | None:
        """Serials to refuse in replicas (None: no list configured nor beside the CA)."""
        from pathlib import Path

        path = Path(self.cfg.crl) if self.cfg.crl else Path(self.cfg.ca).parent / ETCD_CRL
        if not self.cfg.crl and not path.exists():
            return None
        try:
            return serials_in_crl(path)
        except (OSError, ValueError) as e:
            raise CliError(
                _("revocation list {path} cannot be read ({error}); fix or remove the `crl` setting").format(
                    path=path, error=e
                )
            ) from None

    def refused(self, endpoint: str) -> str:
        """Why the replica at `endpoint` is refused before calling it ("" if it is not): it presents
        a revoked certificate, or cannot be verified (grpc-python shows no server certificate to a
        client, so one TLS handshake of our own reads it; server_check.py)."""
        if self.revoked is None:
            return ""
        try:
            serial = serial_hex(presented_certificate(endpoint, self.tls, timeout=self.timeout_s))
        except OSError as e:
            return str(e) or type(e).__name__
        if serial in self.revoked:
            return _("presents certificate {serial}, which is revoked").format(serial=serial)
        return ""

    def channel(self, endpoint: str) -> grpc.Channel:
        """A channel to one replica; raises RefusedReplica (a grpc.RpcError, UNAVAILABLE) when the
        replica presents a revoked certificate."""
        why = self.refused(endpoint)
        if why:
            raise RefusedReplica(f"{endpoint}: {why}")
        return grpc.secure_channel(endpoint, self.creds)

    def call(self, fn: Callable[[cluster_pb2_grpc.ClusterServiceStub], Callable[..., T]], request: Any) -> T:
        """Call a ClusterService method on the first replica that answers."""
        return self.call_stub(cluster_pb2_grpc.ClusterServiceStub, fn, request)

    def workloads(
        self, fn: Callable[[workload_pb2_grpc.WorkloadServiceStub], Callable[..., T]], request: Any
    ) -> T:
        """Call a WorkloadService method on the first replica that answers."""
        return self.call_stub(workload_pb2_grpc.WorkloadServiceStub, fn, request)

    def all_workloads(self, page_size: int = PAGE_SIZE) -> list[workload_pb2.WorkloadSummary]:
        """Every workload, oldest first, fetched in pages read at one revision."""
        out: list[workload_pb2.WorkloadSummary] = self.pages(
            workload_pb2_grpc.WorkloadServiceStub,
            lambda s: s.ListWorkloads,
            workload_pb2.ListWorkloadsRequest(),
            "workloads",
            page_size,
        )
        out.sort(key=lambda s: s.workload.created_at_unix_ms)
        return out

    def iter_pages(
        self,
        stub_cls: Callable[[grpc.Channel], S],
        fn: Callable[[S], Callable[..., Any]],
        request: Any,
        field: str,
        page_size: int = PAGE_SIZE,
    ) -> Iterator[Any]:
        """The items (`field` of each answer) of a paged List call, page after page (`responses`)."""
        for resp in self.responses(stub_cls, fn, request, field, page_size):
            yield from getattr(resp, field)

    def responses(
        self,
        stub_cls: Callable[[grpc.Channel], S],
        fn: Callable[[S], Callable[..., Any]],
        request: Any,
        field: str,
        page_size: int = PAGE_SIZE,
    ) -> Iterator[Any]:
        """The answers of a paged List call (of `field` items), page after page: every page is
        read at the first page's revision (controlplane/paging.py), whichever replica answers it.
        A replica from before paging answers everything in its first reply, with no token, which
        ends the loop too."""
        request.page_size = page_size
        request.page_token = ""
        channels: dict[str, grpc.Channel] = {}  # one connection per replica for all the pages
        try:
            for _page in range(1_000_000):  # bounded: every page moves forward
                resp = self.call_stub(stub_cls, fn, request, channels)
                yield resp
                request.page_token = resp.next_page_token
                if not request.page_token:
                    return
            raise CliError(_("{field}: the listing did not end after a million pages").format(field=field))
        finally:
            for ch in channels.values():
                ch.close()

    def pages(
        self,
        stub_cls: Callable[[grpc.Channel], S],
        fn: Callable[[S], Callable[..., Any]],
        request: Any,
        field: str,
        page_size: int = PAGE_SIZE,
    ) -> list[Any]:
        """Every item of a paged List call (see `iter_pages`), in the server's key order."""
        return list(self.iter_pages(stub_cls, fn, request, field, page_size))

    def cluster_pages(
        self,
        fn: Callable[[cluster_pb2_grpc.ClusterServiceStub], Callable[..., Any]],
        request: Any,
        field: str,
    ) -> list[Any]:
        """Every item of a paged ClusterService List call."""
        return self.pages(cluster_pb2_grpc.ClusterServiceStub, fn, request, field)

    def _channel_for(
        self, ep: str, channels: dict[str, grpc.Channel] | None
    ) -> contextlib.AbstractContextManager[grpc.Channel]:
        """A new channel (closed after the call), or the kept one for `ep` when `channels` is given
        (the caller checked the replica's certificate, `refused`)."""
        if channels is None:
            return grpc.secure_channel(ep, self.creds)
        if ep not in channels:
            channels[ep] = grpc.secure_channel(ep, self.creds)
        return contextlib.nullcontext(channels[ep])

    def call_stub(
        self,
        stub_cls: Callable[[grpc.Channel], S],
        fn: Callable[[S], Callable[..., T]],
        request: Any,
        channels: dict[str, grpc.Channel] | None = None,
    ) -> T:
        """Call a method on the first replica that answers; fail over on unavailable or timeout.
        `channels`: connections to reuse (kept open by the caller), else one per call."""
        errors: list[str] = []
        for ep in self.cfg.endpoints:
            if channels is None or ep not in channels:  # a kept channel's replica was checked
                why = self.refused(ep)
                if why:
                    errors.append(f"{ep}: {_short(why)}")
                    continue
            with self._channel_for(ep, channels) as ch:
                stub = stub_cls(ch)
                try:
                    result = fn(stub)(request, timeout=self.timeout_s)
                    self.answered_by = ep
                    return result
                except grpc.RpcError as e:
                    code = e.code()
                    detail = server_message(e)
                    if code in _FAILOVER:
                        errors.append(f"{ep}: {_short(detail)}")
                        continue
                    raise CliError(f"{ep}: {status_text(code)}: {detail}") from None
        raise CliError(
            _(
                "no replica answered ({errors}); check that the cluster runs (`make demo`) "
                "and that the endpoints in your client config are right"
            ).format(errors="; ".join(errors))
        )


def server_message(e: grpc.RpcError) -> str:
    """A replica's error text in the reader's language: the translation of the message id it sent
    in its trailing metadata (kunlun_common/messages.py), else its English details as sent."""
    code = e.code()
    detail: str = e.details() or code.name
    try:
        m = from_metadata(e.trailing_metadata())
    except Exception:  # a channel-level error carries no usable metadata
        m = None
    return detail if m is None else localize(m, english=detail)


def status_text(code: grpc.StatusCode) -> str:
    """The status code as words, e.g. "not found" (translated: it prefixes the message)."""
    words = {
        grpc.StatusCode.INVALID_ARGUMENT: _("invalid argument"),
        grpc.StatusCode.NOT_FOUND: _("not found"),
        grpc.StatusCode.PERMISSION_DENIED: _("permission denied"),
        grpc.StatusCode.UNAUTHENTICATED: _("unauthenticated"),
        grpc.StatusCode.FAILED_PRECONDITION: _("failed precondition"),
        grpc.StatusCode.ABORTED: _("aborted"),
        grpc.StatusCode.ALREADY_EXISTS: _("already exists"),
        grpc.StatusCode.RESOURCE_EXHAUSTED: _("resource exhausted"),
        grpc.StatusCode.UNIMPLEMENTED: _("unimplemented"),
        grpc.StatusCode.INTERNAL: _("internal"),
        grpc.StatusCode.UNKNOWN: _("unknown"),
    }
    return words.get(code) or str(code.name).lower().replace("_", " ")


def _short(detail: str) -> str:
    d = detail.replace("\n", " ")
    if "failed to connect to all addresses" in d or "Connection refused" in d:
        return _("connection refused")
    if "Deadline Exceeded" in d:
        return _("no answer within the deadline")
    return d[:160]
