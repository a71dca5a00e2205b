"""The security matrix: every certificate kind against every listener of a running local cluster.

Generated from two tables, LISTENER_KINDS (how to probe each kind of listener, and who is meant
to get in) and CERT_KINDS (how to build each certificate). Every TCP port the cluster's processes
listen on must belong to a listener kind of the table, so a new listener without rows fails. The
table of results is printed (run with -s to see it).

The module's cluster runs its gateways as production does: HTTPS with the gateway's certificate
and API keys required. A gateway's clients authenticate with TLS (they check the gateway's
certificate and name) plus an API key; the gateway asks for no client certificate. So at a gateway
"let in" means: the TLS handshake passed and the API key was accepted (200 on /v1/models); each
kind's certificate is offered with a valid key and plays no part, except that the "revoked" kind
there carries a revoked API key (the gateway's revocable credential) and the "wrong host name" kind
checks a name the gateway's certificate does not carry.
"""

from __future__ import annotations

import datetime as dt
import http.client
import shutil
import socket
import ssl
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from aetcd import rpc as etcd_rpc

from devcluster.cluster import LocalCluster
from devcluster.procs import ManagedProcess, free_port, wait_for
from kunlun_common.api import (
    agent_pb2,
    agent_pb2_grpc,
    cluster_pb2,
    cluster_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
)
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
from tests.conftest import FAST_TMP, start_cluster

WRONG_NAME = "wrong-host.example"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """The whole local cluster of conftest's `cluster`, with HTTPS gateways that require API keys."""
    base = Path(tempfile.mkdtemp(prefix="kunlun-matrix-", dir=FAST_TMP))
    c = start_cluster(base, extra_nodes=("node-x", "node-c"), gateway_https=True)
    try:
        yield c
    finally:
        c.stop()
        shutil.rmtree(base, ignore_errors=True)


@dataclass(frozen=True)
class Cred:
    """A client's certificate for one listener kind, and the name it checks the server against."""

    cert: Path
    key: Path
    expect_name: str = ""  # "" = the address's host
    api_key: str = ""  # the Bearer key sent to a gateway


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


def gateway_get(address: str, ca: Path, c: Cred, path: str = "/v1/models") -> str:
    """GET over verified HTTPS, offering the certificate (the gateway asks for none) and the key."""
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.load_cert_chain(str(c.cert), str(c.key))
    host, port = address.rsplit(":", 1)
    headers = {"Authorization": f"Bearer {c.api_key}"} if c.api_key else {}
    try:
        sock = socket.create_connection((host, int(port)), timeout=5)
        conn = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=5)
        conn.sock = ctx.wrap_socket(sock, server_hostname=c.expect_name or host)
        conn.request("GET", path, headers=headers)
        status = conn.getresponse().status
        conn.close()
        return "IN" if status == 200 else f"http-{status}"
    except (ssl.SSLError, OSError, http.client.HTTPException):
        return "tls"


def probe_gateway_https(ls: Listener, ca: Path, c: Cred) -> str:
    return gateway_get(ls.address, ca, c)


def plain_http(address: str, api_key: str) -> str:
    """Plain HTTP (with a valid key) to an HTTPS port: "refused" when no HTTP answer comes."""
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {api_key}"})
        return f"http-{conn.getresponse().status}"
    except (OSError, http.client.HTTPException):
        return "refused"
    finally:
        conn.close()


@dataclass(frozen=True)
class ListenerKind:
    probe: Callable[[Listener, Path, Cred], str]
    trust: str  # which CA a correct client trusts for the server: replica | cluster | etcd
    cert_side: str  # which of a kind's certificates it presents: main | etcd | gateway (main + API key)
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
    # TLS (the client checks the gateway's certificate and name) plus an API key; no client
    # certificate is asked for: in = handshake passed and key accepted
    "gateway HTTPS": ListenerKind(
        probe_gateway_https, "cluster", "gateway", frozenset(ALL) - {"revoked", "wrong host name"}
    ),
    "metrics HTTPS": ListenerKind(probe_metrics, "cluster", "main", frozenset({"monitoring"})),
}


def cert_kinds(cert_dir: Path, tmp: Path, keys: tuple[str, str]) -> dict[str, dict[str, Cred]]:
    """kind -> {"main": certificate for Kunlun listeners, "etcd": the one it would show etcd,
    "gateway": the main one with the API key sent to gateways}. `keys`: (valid, revoked) API keys."""
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

    out = {
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
    valid, revoked_key = keys
    for kind, creds in out.items():
        m = creds["main"]
        creds["gateway"] = Cred(m.cert, m.key, m.expect_name, revoked_key if kind == "revoked" else valid)
    return out


def _gateway_stub(cluster: LocalCluster) -> tuple[grpc.Channel, gateway_pb2_grpc.GatewayServiceStub]:
    from kunlun_common.tls import channel_credentials, load_tls

    creds = channel_credentials(load_tls(paths_for(cluster.cert_dir, "operator", "admin")))
    ch = grpc.secure_channel(cluster.replica_addrs["replica-1"], creds)
    return ch, gateway_pb2_grpc.GatewayServiceStub(ch)


def api_keys(cluster: LocalCluster) -> tuple[str, str]:
    """(a valid API key, a revoked one), as `kunlun-cli gateway keys create/revoke` make them,
    once every gateway accepts the first."""
    ch, stub = _gateway_stub(cluster)
    with ch:
        valid = stub.CreateApiKey(gateway_pb2.CreateApiKeyRequest(name="matrix"), timeout=10).secret
        gone = stub.CreateApiKey(gateway_pb2.CreateApiKeyRequest(name="matrix-revoked"), timeout=10)
        stub.RevokeApiKey(gateway_pb2.RevokeApiKeyRequest(id=gone.key.id), timeout=10)
    ca = cluster.cert_dir / "ca.crt"
    op = paths_for(cluster.cert_dir, "operator", "admin")
    for name, address in cluster.gateway_addrs.items():
        wait_for(
            lambda a=address: gateway_get(a, ca, Cred(op.cert, op.key, api_key=valid)) == "IN",
            30,
            f"gateway {name} to accept the new API key",
        )
    return valid, gone.secret


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
    out += [Listener("gateway HTTPS", n, a) for n, a in cluster.gateway_addrs.items()]
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
    kinds = cert_kinds(cluster.cert_dir, tmp_path, api_keys(cluster))
    assert set(kinds) == set(ALL)
    revoke_for_matrix(cluster, kinds)
    cas = {
        "replica": cluster.cert_dir / "replica-ca.crt",
        "cluster": cluster.cert_dir / "ca.crt",
        "etcd": cluster.cert_dir / "etcd-ca.crt",
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
            ok = (got == "IN") == allowed
            if not ok:
                wrong.append(f"{ls.kind} {ls.name} x {k}: {got} (meant {'in' if allowed else 'out'})")
            row.append(f"{got:^9.9}")
        lines.append(f"{ls.kind + ' ' + ls.name:<{width}} | " + " | ".join(row))
    table = "\n".join(lines)
    print(
        "\nsecurity matrix (IN: let in; tls: refused in the TLS handshake (for etcd and a revoked"
        " certificate: by its CRL); rbac: refused by etcd's RBAC; http-403: refused by role or revoked;"
        " unauthent: UNAUTHENTICATED, revoked; at a gateway (HTTPS, API keys, no client certificate"
        " asked): IN = TLS handshake and API key accepted, with each kind's certificate offered and a"
        " valid key, the revoked kind with a revoked key: http-401)\n" + table
    )
    (Path(__file__).parent.parent / ".security-matrix.txt").write_text(table + "\n")
    assert not wrong, "\n".join(wrong)


def _standalone_gateway(tmp: Path, name: str, pair: CertPaths) -> tuple[ManagedProcess, str]:
    """A kunlun-gateway without a control plane serving HTTPS with `pair` (no API keys: those
    come from the control plane)."""
    address = f"127.0.0.1:{free_port()}"
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(
        f"name: {name}\nlisten: {address}\nstatic_endpoints: ['chat=127.0.0.1:9']\n"
        f"tls_cert: {pair.cert}\ntls_key: {pair.key}\n"
    )
    proc = ManagedProcess(
        name, [sys.executable, "-m", "gateway.main", "--config", str(cfg)], tmp / f"{name}.log"
    )
    proc.start()
    return proc, address


def test_gateway_https_refusals(cluster: LocalCluster, tmp_path: Path) -> None:
    """Each gateway of the cluster: plain HTTP to its HTTPS port and a request without an API key
    are refused. A gateway serving a certificate without the host's name is refused by a client
    that checks the name (and accepted by one that expects the name it carries); a gateway given
    an expired certificate refuses to start."""
    ca = cluster.cert_dir / "ca.crt"
    op = paths_for(cluster.cert_dir, "operator", "admin")
    valid, revoked_key = api_keys(cluster)
    rows: dict[str, dict[str, str]] = {}
    for name, address in cluster.gateway_addrs.items():
        rows[f"gateway HTTPS {name}"] = {
            "plain HTTP": plain_http(address, valid),
            "no API key": gateway_get(address, ca, Cred(op.cert, op.key)),
            "revoked key": gateway_get(address, ca, Cred(op.cert, op.key, api_key=revoked_key)),
            "valid key": gateway_get(address, ca, Cred(op.cert, op.key, api_key=valid)),
        }
    copy = tmp_path / "copy"
    shutil.copytree(cluster.cert_dir, copy)
    shutil.copytree(ca_key_dir(cluster.cert_dir), ca_key_dir(copy))
    wrong = issue(copy, "gateway", "gw-wrong-name", hosts=(WRONG_NAME,))
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=30)
    expired = issue(copy, "gateway", "gw-expired", not_before=past, not_after=past + dt.timedelta(days=1))
    gw_wrong, wrong_addr = _standalone_gateway(tmp_path, "gw-wrong-name", wrong)
    gw_expired, _ = _standalone_gateway(tmp_path, "gw-expired", expired)
    try:
        wait_for(
            lambda: gw_wrong.log_text().count("gateway serving") > 0, 60, "the wrong-name gateway to serve"
        )
        rows["server cert for another host"] = {
            "client checks 127.0.0.1": gateway_get(wrong_addr, ca, Cred(op.cert, op.key), "/health"),
            f"client expects {WRONG_NAME}": gateway_get(
                wrong_addr, ca, Cred(op.cert, op.key, WRONG_NAME), "/health"
            ),
        }
        wait_for(lambda: not gw_expired.alive(), 60, "the gateway with an expired certificate to exit")
        refused = "the certificate expired" in gw_expired.log_text()
        rows["expired server cert"] = {"gateway start": "refused" if refused else "started"}
    finally:
        gw_wrong.stop()
        gw_expired.stop()
    print("\ngateway HTTPS refusals (tls: the client refused the handshake; http-401: no or revoked API key)")
    for row, cells in rows.items():
        print(f"{row:<30} | " + " | ".join(f"{k}: {v}" for k, v in cells.items()))
    for name in cluster.gateway_addrs:
        r = rows[f"gateway HTTPS {name}"]
        assert r["plain HTTP"] == "refused" or r["plain HTTP"].startswith("http-4"), r
        assert (r["no API key"], r["revoked key"], r["valid key"]) == ("http-401", "http-401", "IN"), r
    assert rows["server cert for another host"] == {
        "client checks 127.0.0.1": "tls",
        f"client expects {WRONG_NAME}": "IN",
    }
    assert rows["expired server cert"] == {"gateway start": "refused"}, gw_expired.log_text()[-2000:]


class _Rogue(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    """Records every call; serves none (UNIMPLEMENTED)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def service(self, details: grpc.HandlerCallDetails) -> None:
        with self.lock:
            self.calls.append(details.method)


def test_a_fresh_agent_fetches_the_revocation_list_before_trusting_a_replica(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """A server holding a revoked replica certificate (real replica CA, this host's names) stands
    first in a freshly started agent's replica list. The agent knows no revocation when it starts;
    it must fetch the list (from every replica) before it connects, so the rogue never gets its
    registration; it registers with a real replica instead. Before the first list the agent's
    NodeService refuses every caller."""
    from cryptography import x509

    from kunlun_common.api import security_pb2, security_pb2_grpc
    from kunlun_common.tls import channel_credentials, load_tls

    copy = tmp_path / "copy"
    shutil.copytree(cluster.cert_dir, copy)
    shutil.copytree(ca_key_dir(cluster.cert_dir), ca_key_dir(copy))
    rogue_pair = issue(copy, "replica", "replica-1", overwrite=True)
    serial = x509.load_pem_x509_certificate(rogue_pair.cert.read_bytes()).serial_number
    creds = channel_credentials(load_tls(paths_for(cluster.cert_dir, "operator", "admin")))
    with grpc.secure_channel(cluster.replica_addrs["replica-1"], creds) as ch:
        security_pb2_grpc.SecurityServiceStub(ch).RevokeCertificate(
            security_pb2.RevokeCertificateRequest(serial=f"{serial:x}", name="rogue replica"), timeout=10
        )
    rogue = _Rogue()
    server = grpc.server(ThreadPoolExecutor(4), handlers=[rogue])
    port = server.add_secure_port(
        "127.0.0.1:0",
        grpc.ssl_server_credentials(
            [(rogue_pair.key.read_bytes(), rogue_pair.cert.read_bytes())],
            root_certificates=(cluster.cert_dir / "ca.crt").read_bytes(),
            require_client_auth=True,
        ),
    )
    server.start()
    config = tmp_path / "node-c.yaml"
    config.write_text(cluster.spec.node_configs[0].read_text().replace("name: node-a", "name: node-c"))
    argv = [
        f"--endpoints=127.0.0.1:{port},{','.join(cluster.endpoints)}" if a.startswith("--endpoints=") else a
        for a in cluster.agent_argv(config, "node-c")
        if not a.startswith(("--state-dir=", "--metrics-listen="))
    ]
    agent = ManagedProcess(
        "agent-node-c", [*argv, f"--state-dir={tmp_path / 'state'}"], tmp_path / "agent.log"
    )
    agent.start()
    try:
        wait_for(lambda: cluster.node_ready("node-c"), 90, "node-c to register with a real replica")
        log = agent.log_text()
        assert not [m for m in rogue.calls if "AgentService" in m], (rogue.calls, log[-3000:])
        assert "revocation list fetched" in log
        assert f"{serial:x}" in log and "was revoked" in log, log[-3000:]  # the link refused the rogue
    finally:
        agent.stop()
        server.stop(None)


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
