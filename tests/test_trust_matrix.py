"""The security matrix: every certificate kind against every listener of a running local cluster.

Generated from two tables, LISTENER_KINDS (how to probe each kind of listener, and who is meant
to get in) and CERT_KINDS (how to build each certificate). Every TCP port the cluster's processes
listen on must belong to a listener kind of the table, so a new listener without rows fails. The
table of results is printed (run with -s to see it).
"""

from __future__ import annotations

import datetime as dt
import http.client
import shutil
import socket
import ssl
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
from aetcd import rpc as etcd_rpc

from devcluster.cluster import LocalCluster
from devcluster.procs import wait_for
from kunlun_common.api import agent_pb2, agent_pb2_grpc, cluster_pb2, cluster_pb2_grpc
from kunlun_common.pki import (
    ETCD_CLIENT,
    ETCD_USER,
    CertPaths,
    ClusterCerts,
    ca_key_dir,
    etcd_client_paths,
    init_cluster_certs,
    issue,
    paths_for,
)

WRONG_NAME = "wrong-host.example"


@dataclass(frozen=True)
class Cred:
    """A client's certificate for one listener kind, and the name it checks the server against."""

    cert: Path
    key: Path
    expect_name: str = ""  # "" = the address's host


@dataclass(frozen=True)
class Listener:
    kind: str
    name: str
    address: str
    server_name: str = ""  # the name a correct client checks ("" = the address's host)


def _grpc_creds(ca: Path, c: Cred) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(ca.read_bytes(), c.key.read_bytes(), c.cert.read_bytes())


def _opts(name: str) -> list[tuple[str, str]]:
    return [("grpc.ssl_target_name_override", name)] if name else []


def _outcome(e: grpc.RpcError) -> str:
    code = e.code()
    return "tls" if code == grpc.StatusCode.UNAVAILABLE else code.name.lower()


def probe_replica(ls: Listener, ca: Path, c: Cred) -> str:
    with grpc.secure_channel(ls.address, _grpc_creds(ca, c), options=_opts(c.expect_name)) as ch:
        try:
            cluster_pb2_grpc.ClusterServiceStub(ch).WhoAmI(cluster_pb2.WhoAmIRequest(), timeout=5)
            return "IN"
        except grpc.RpcError as e:
            return _outcome(e)


def probe_node_service(ls: Listener, ca: Path, c: Cred) -> str:
    name = c.expect_name or ls.server_name
    with grpc.secure_channel(ls.address, _grpc_creds(ca, c), options=_opts(name)) as ch:
        try:
            for _ in agent_pb2_grpc.NodeServiceStub(ch).Logs(
                agent_pb2.LogsRequest(instance_id="w-none-0"), timeout=5
            ):
                pass
            return "IN"
        except grpc.RpcError as e:
            return "IN" if e.code() == grpc.StatusCode.NOT_FOUND else _outcome(e)


def probe_etcd_client(ls: Listener, ca: Path, c: Cred) -> str:
    with grpc.secure_channel(ls.address, _grpc_creds(ca, c), options=_opts(c.expect_name)) as ch:
        try:
            etcd_rpc.KVStub(ch).Range(etcd_rpc.RangeRequest(key=b"/kunlun/v1/nodes/node-a"), timeout=5)
            return "IN"
        except grpc.RpcError as e:
            details = e.details() or ""
            return "rbac" if "permission denied" in details or "user name" in details else _outcome(e)


def probe_etcd_peer(ls: Listener, ca: Path, c: Cred) -> str:
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.load_cert_chain(str(c.cert), str(c.key))
    host, port = ls.address.rsplit(":", 1)
    try:
        conn = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=5)
        if c.expect_name:
            conn = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=5)
            sock = socket.create_connection((host, int(port)), timeout=5)
            conn.sock = ctx.wrap_socket(sock, server_hostname=c.expect_name)
        conn.request("GET", "/members")
        status = conn.getresponse().status
        conn.close()
        return "IN" if status == 200 else f"http-{status}"
    except (ssl.SSLError, OSError):
        return "tls"


def probe_metrics(ls: Listener, ca: Path, c: Cred) -> str:
    ctx = ssl.create_default_context()
    ctx.load_verify_locations(cafile=str(ca))
    ctx.load_verify_locations(cafile=str(ca.with_name("replica-ca.crt")))  # replicas' exporters
    ctx.load_cert_chain(str(c.cert), str(c.key))
    host, port = ls.address.rsplit(":", 1)
    try:
        sock = socket.create_connection((host, int(port)), timeout=5)
        conn = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=5)
        conn.sock = ctx.wrap_socket(sock, server_hostname=c.expect_name or host)
        conn.request("GET", "/metrics")
        status = conn.getresponse().status
        conn.close()
        return "IN" if status == 200 else f"http-{status}"
    except (ssl.SSLError, OSError, http.client.HTTPException):
        return "tls"


def probe_plain_http(ls: Listener, ca: Path, c: Cred) -> str:
    host, port = ls.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request("GET", "/health")
        status = conn.getresponse().status
        return "open" if status < 500 else f"http-{status}"
    except (OSError, http.client.HTTPException) as e:
        return type(e).__name__[:9]
    finally:
        conn.close()


@dataclass(frozen=True)
class ListenerKind:
    probe: Callable[[Listener, Path, Cred], str]
    trust: str  # which CA a correct client trusts for the server: replica | cluster | etcd | none
    cert_side: str  # which of a kind's certificates it presents: main | etcd
    allowed: frozenset[str]  # certificate kinds meant to get in


ALL = (
    "replica",
    "agent",
    "gateway",
    "operator",
    "viewer",
    "monitoring",
    "etcd peer",
    "foreign CA",
    "expired",
    "revoked",
    "wrong host name",
)
LISTENER_KINDS: dict[str, ListenerKind] = {
    "replica gRPC": ListenerKind(
        probe_replica, "replica", "main", frozenset({"replica", "agent", "gateway", "operator", "viewer"})
    ),
    "etcd client": ListenerKind(probe_etcd_client, "etcd", "etcd", frozenset({"replica"})),
    "etcd peer": ListenerKind(probe_etcd_peer, "etcd", "etcd", frozenset({"etcd peer"})),
    "agent NodeService": ListenerKind(probe_node_service, "cluster", "main", frozenset({"replica"})),
    # plain HTTP on loopback in the dev cluster (the demo says so); no certificate is asked for
    "gateway HTTP": ListenerKind(probe_plain_http, "none", "main", frozenset(ALL)),
    "metrics HTTPS": ListenerKind(probe_metrics, "cluster", "main", frozenset({"monitoring"})),
}


def cert_kinds(cert_dir: Path, tmp: Path) -> dict[str, dict[str, Cred]]:
    """kind -> {"main": certificate for Kunlun listeners, "etcd": the one it would show etcd}."""
    foreign = tmp / "foreign"
    init_cluster_certs(foreign, ClusterCerts())
    # an expired certificate from the real CAs (in a copy of the folder and its CA keys)
    copy = tmp / "copy"
    shutil.copytree(cert_dir, copy)
    shutil.copytree(ca_key_dir(cert_dir), ca_key_dir(copy))
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=30)
    old = {"not_before": past, "not_after": past + dt.timedelta(days=1), "overwrite": True}
    exp_main = issue(copy, "operator", "expired", **old)  # type: ignore[arg-type]
    exp_etcd = issue(copy, ETCD_CLIENT, ETCD_USER, **old)  # type: ignore[arg-type]
    # a replica certificate and an etcd client certificate (CN kunlun) from the real CAs, revoked
    # (see revoke_for_matrix): the most powerful certificates, refused once on the list
    revoked = tmp / "revoked"
    shutil.copytree(cert_dir, revoked)
    shutil.copytree(ca_key_dir(cert_dir), ca_key_dir(revoked))
    rev_main = issue(revoked, "replica", "replica-1", overwrite=True)
    rev_etcd = issue(revoked, ETCD_CLIENT, ETCD_USER, overwrite=True)

    def c(p: CertPaths, name: str = "") -> Cred:
        return Cred(p.cert, p.key, name)

    def both(main: CertPaths, etcd: CertPaths | None = None, name: str = "") -> dict[str, Cred]:
        return {"main": c(main, name), "etcd": c(etcd or main, name)}

    return {
        "replica": both(paths_for(cert_dir, "replica", "replica-1"), etcd_client_paths(cert_dir)),
        "agent": both(paths_for(cert_dir, "agent", "node-a")),
        "gateway": both(paths_for(cert_dir, "gateway", "gateway-1")),
        "operator": both(paths_for(cert_dir, "operator", "admin")),
        "viewer": both(paths_for(cert_dir, "viewer", "viewer")),
        "monitoring": both(paths_for(cert_dir, "monitoring", "prometheus")),
        "etcd peer": both(paths_for(cert_dir, "etcd", "etcd-1")),
        "foreign CA": both(paths_for(foreign, "operator", "admin"), etcd_client_paths(foreign)),
        "expired": both(exp_main, exp_etcd),
        "revoked": both(rev_main, rev_etcd),
        # the genuine certificates, but the client expects a name the server does not carry
        "wrong host name": both(
            paths_for(cert_dir, "replica", "replica-1"), etcd_client_paths(cert_dir), WRONG_NAME
        ),
    }


def revoke_for_matrix(cluster: LocalCluster, kinds: dict[str, dict[str, Cred]]) -> None:
    """Revoke the "revoked" kind's certificates as an operator would (`certs revoke --dir`): the
    revocation list in etcd, and etcd's CRL; wait until the agents enforce it too."""
    from cryptography import x509

    from kunlun_common.api import security_pb2, security_pb2_grpc
    from kunlun_common.pki import write_crl
    from kunlun_common.tls import channel_credentials, load_tls

    serials = [
        x509.load_pem_x509_certificate(c.cert.read_bytes()).serial_number for c in kinds["revoked"].values()
    ]
    creds = channel_credentials(load_tls(paths_for(cluster.cert_dir, "operator", "admin")))
    with grpc.secure_channel(next(iter(cluster.replica_addrs.values())), creds) as ch:
        stub = security_pb2_grpc.SecurityServiceStub(ch)
        for s in serials:
            stub.RevokeCertificate(
                security_pb2.RevokeCertificateRequest(serial=f"{s:x}", name="matrix"), timeout=10
            )
        listed = stub.ListRevocations(security_pb2.ListRevocationsRequest(), timeout=10).revocations
    write_crl(cluster.cert_dir, (int(r.serial, 16) for r in listed))
    cluster.distribute_crl()
    ca = cluster.cert_dir / "ca.crt"
    for agent in (ls for ls in listeners(cluster) if ls.kind == "agent NodeService"):  # each polls alone
        wait_for(
            lambda agent=agent: probe_node_service(agent, ca, kinds["revoked"]["main"]) != "IN",
            30,
            f"agent {agent.name} to learn it",
        )


def listeners(cluster: LocalCluster) -> list[Listener]:
    out = [Listener("replica gRPC", n, a) for n, a in cluster.replica_addrs.items()]
    for m in cluster.etcd.members:
        out.append(Listener("etcd client", m.name, f"127.0.0.1:{m.client_port}"))
        out.append(Listener("etcd peer", m.name, f"127.0.0.1:{m.peer_port}"))
    resp = cluster.call_any("ListNodes", cluster_pb2.ListNodesRequest())
    assert isinstance(resp, cluster_pb2.ListNodesResponse)
    for n in resp.nodes:
        if n.name in cluster.agents:
            out.append(Listener("agent NodeService", n.name, n.node_service, server_name=n.name))
    out += [Listener("gateway HTTP", n, a) for n, a in cluster.gateway_addrs.items()]
    out += [Listener("metrics HTTPS", n, a) for n, a in getattr(cluster, "metrics_addrs", {}).items()]
    return out


def _listening_ports(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = str(fd.readlink()) if fd.is_symlink() else ""
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return set()
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def test_every_listening_port_is_in_the_table(cluster: LocalCluster) -> None:
    known = {int(ls.address.rsplit(":", 1)[1]) for ls in listeners(cluster)}
    assert {ls.kind for ls in listeners(cluster)} <= set(LISTENER_KINDS)
    for proc in cluster.all_procs():
        if proc.pid:
            unknown = _listening_ports(proc.pid) - known
            assert not unknown, (
                f"{proc.name} listens on {sorted(unknown)}: add its listener kind to the matrix"
            )


def test_security_matrix(cluster: LocalCluster, tmp_path: Path) -> None:
    kinds = cert_kinds(cluster.cert_dir, tmp_path)
    assert set(kinds) == set(ALL)
    revoke_for_matrix(cluster, kinds)
    cas = {
        "replica": cluster.cert_dir / "replica-ca.crt",
        "cluster": cluster.cert_dir / "ca.crt",
        "etcd": cluster.cert_dir / "etcd-ca.crt",
        "none": cluster.cert_dir / "ca.crt",
    }
    cells = [(ls, k) for ls in listeners(cluster) for k in ALL]

    def run(cell: tuple[Listener, str]) -> str:
        ls, k = cell
        lk = LISTENER_KINDS[ls.kind]
        return lk.probe(ls, cas[lk.trust], kinds[k][lk.cert_side])

    with ThreadPoolExecutor(8) as pool:
        results = dict(zip(cells, pool.map(run, cells), strict=True))
    width = max(len(f"{ls.kind} {ls.name}") for ls, _ in cells)
    lines = [" " * width + " | " + " | ".join(f"{k:^9.9}" for k in ALL)]
    wrong = []
    for ls in dict.fromkeys(ls for ls, _ in cells):
        row = []
        for k in ALL:
            got = results[(ls, k)]
            allowed = k in LISTENER_KINDS[ls.kind].allowed
            let_in = got in ("IN", "open")
            if ls.kind == "gateway HTTP":
                ok = got == "open"
            else:
                ok = let_in == allowed
            if not ok:
                wrong.append(f"{ls.kind} {ls.name} x {k}: {got} (meant {'in' if allowed else 'out'})")
            row.append(f"{got:^9.9}")
        lines.append(f"{ls.kind + ' ' + ls.name:<{width}} | " + " | ".join(row))
    table = "\n".join(lines)
    print(
        "\nsecurity matrix (IN: let in; tls: refused in the TLS handshake (for etcd and a revoked"
        " certificate: by its CRL); rbac: refused by etcd's RBAC; http-403: refused by role or revoked;"
        " unauthent: UNAUTHENTICATED, revoked; open: plain HTTP on loopback, no certificate asked)\n" + table
    )
    (Path(__file__).parent.parent / ".security-matrix.txt").write_text(table + "\n")
    assert not wrong, "\n".join(wrong)


def _methods() -> list[tuple[str, bool, bool]]:
    """(full name, client streaming, server streaming) of every RPC a replica serves."""
    from kunlun_common import api

    out = []
    for mod_path in sorted(Path(api.__file__).parent.glob("*_pb2.py")):
        mod = __import__(f"kunlun_common.api.{mod_path.stem}", fromlist=["DESCRIPTOR"])
        for svc in mod.DESCRIPTOR.services_by_name.values():
            if svc.name in ("NodeService", "PluginRegistration", "DevicePlugin"):
                continue  # served by agents / plugin hosts, not replicas
            for m in svc.methods:
                out.append((f"/{svc.full_name}/{m.name}", m.client_streaming, m.server_streaming))
    return out


def test_every_rpc_against_every_role(cluster: LocalCluster) -> None:
    """Only the role table's entries pass authorization (an empty request: past the role check a
    call may still fail on its input, which is not PERMISSION_DENIED)."""
    from controlplane.api.auth import PERMISSIONS

    roles = {
        "replica": "replica-1",
        "agent": "node-x",
        "gateway": "gateway-3",
        "operator": "admin",
        "viewer": "viewer",
        "monitoring": "prometheus",
    }
    methods = _methods()
    missing = [m for m, _, _ in methods if m not in PERMISSIONS]
    assert not missing, f"RPCs without a role rule: {missing}"
    address = cluster.replica_addrs["replica-1"]
    ca = cluster.cert_dir / "replica-ca.crt"

    def call(cell: tuple[tuple[str, bool, bool], str]) -> bool:
        (method, cstream, sstream), role = cell
        c = Cred(*(lambda p: (p.cert, p.key))(paths_for(cluster.cert_dir, role, roles[role])))
        with grpc.secure_channel(address, _grpc_creds(ca, c)) as ch:
            ident = lambda b: b  # noqa: E731
            try:
                if cstream:
                    it = ch.stream_stream(method, request_serializer=ident, response_deserializer=ident)(
                        iter([b""]), timeout=2
                    )
                    next(iter(it), None)
                elif sstream:
                    it = ch.unary_stream(method, request_serializer=ident, response_deserializer=ident)(
                        b"", timeout=2
                    )
                    next(iter(it), None)
                else:
                    ch.unary_unary(method, request_serializer=ident, response_deserializer=ident)(
                        b"", timeout=5
                    )
            except grpc.RpcError as e:
                code = e.code()
                assert code != grpc.StatusCode.UNAUTHENTICATED, (method, role)
                by_role_table = "may not call" in (e.details() or "")
                return not (code == grpc.StatusCode.PERMISSION_DENIED and by_role_table)
            return True

    cells = [(m, r) for m in methods for r in roles]
    with ThreadPoolExecutor(8) as pool:
        passed = dict(zip(cells, pool.map(call, cells), strict=True))
    wrong = [
        f"{m[0]} as {r}: {'passed' if ok else 'refused'}"
        for (m, r), ok in passed.items()
        if ok != (r in PERMISSIONS[m[0]])
    ]
    assert not wrong, "\n".join(wrong)
