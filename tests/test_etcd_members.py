"""`kunlun-cli cluster etcd member list|add|remove` against real TLS etcd clusters.

`list` runs on the shared 3-member fixture (read only). Adding and removing a member runs on a
3-member cluster of this module's own, so the shared one is never reconfigured: a 4th member is
added, started from the etcd binary with the settings `add` printed, joins and serves, is removed,
stops by itself, and the three left stay healthy and writable.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from controlplane.cli.main import main
from controlplane.store import EtcdStore
from controlplane.store.admin import enable_etcd_auth
from devcluster.etcd_cluster import EtcdCluster, build_etcd_cluster, member_argv
from devcluster.procs import ManagedProcess, free_port, wait_for
from kunlun_common.pki import ETCD_ADMIN, ETCD_CA, ETCD_CLIENT, ETCD_USER, bundle, issue
from tests.conftest import _etcd_ready, store_settings


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., Run]:
    """`kunlun-cli ARGS` in this process: exit code, stdout, stderr."""

    def run(*args: str) -> Run:
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main(list(args))
        out = capsys.readouterr()
        return Run(int(e.value.code or 0), out.out, out.err)

    return run


@pytest.fixture(scope="module")
def own_etcd(tmp_base: Path, cert_dir: Path) -> Iterator[EtcdCluster]:
    cluster = build_etcd_cluster(tmp_base / "etcd-members", cert_dir, token="kunlun-members-test")
    cluster.start()
    try:
        wait_for(lambda: _etcd_ready(cert_dir, cluster.endpoints), 60, "etcd cluster")
        enable_etcd_auth(cluster.endpoints, cert_dir)
        yield cluster
    finally:
        cluster.stop()


def members(cli: Callable[..., Run], eps: tuple[str, ...], cert_dir: Path) -> dict[str, dict[str, object]]:
    r = cli(
        "cluster",
        "etcd",
        "member",
        "list",
        "-o",
        "json",
        "--etcd-endpoints",
        ",".join(eps),
        "--etcd-cert-dir",
        str(cert_dir),
    )
    assert r.returncode == 0, r.stderr
    return {str(m["name"] or m["id"]): m for m in json.loads(r.stdout)["items"]}


def test_list_shows_three_healthy_members_and_one_leader(
    etcd: EtcdCluster, cert_dir: Path, cli: Callable[..., Run]
) -> None:
    found = members(cli, etcd.endpoints, cert_dir)
    assert sorted(found) == ["etcd-1", "etcd-2", "etcd-3"]
    assert all(m["healthy"] and m["started"] and not m["learner"] for m in found.values()), found
    assert sum(1 for m in found.values() if m["leader"]) == 1
    assert {tuple(m["client_urls"]) for m in found.values()} == {(ep,) for ep in etcd.endpoints}  # type: ignore[arg-type]
    table = cli(
        "cluster",
        "etcd",
        "member",
        "list",
        "--etcd-endpoints",
        etcd.endpoints[0],
        "--etcd-cert-dir",
        str(cert_dir),
    )
    assert table.returncode == 0 and table.stdout.splitlines()[0].split()[:3] == ["ID", "NAME", "PEER"]


def test_replicas_etcd_user_cannot_change_members(
    etcd: EtcdCluster, cert_dir: Path, tmp_path: Path, cli: Callable[..., Run]
) -> None:
    """Why the admin certificate: the replicas' etcd user is refused by etcd itself."""
    fake = tmp_path / "certs"
    (fake / ETCD_CLIENT).mkdir(parents=True)
    shutil.copy(cert_dir / ETCD_CA, fake / ETCD_CA)
    for ext in ("crt", "key"):  # the replicas' `kunlun` certificate where the admin's should be
        shutil.copy(cert_dir / ETCD_CLIENT / f"{ETCD_USER}.{ext}", fake / ETCD_CLIENT / f"{ETCD_ADMIN}.{ext}")
    r = cli(
        "cluster", "etcd", "member", "add", "etcd-9", "--peer-urls", "https://127.0.0.1:1",
        "--etcd-endpoints", ",".join(etcd.endpoints), "--etcd-cert-dir", str(fake),
    )  # fmt: skip
    assert r.returncode == 1 and "PERMISSION_DENIED" in r.stderr, r.stderr
    assert sorted(members(cli, etcd.endpoints, cert_dir)) == ["etcd-1", "etcd-2", "etcd-3"]


def test_add_a_fourth_member_then_remove_it(
    own_etcd: EtcdCluster, cert_dir: Path, tmp_base: Path, cli: Callable[..., Run]
) -> None:
    eps = own_etcd.endpoints
    common = ("--etcd-endpoints", ",".join(eps), "--etcd-cert-dir", str(cert_dir))
    r = cli("cluster", "etcd", "member", "add", "etcd-4", "--peer-urls", "http://127.0.0.1:2380", *common)
    assert r.returncode == 1 and "--peer-urls" in r.stderr and "https://HOST:PORT" in r.stderr, r.stderr
    r = cli("cluster", "etcd", "member", "add", "etcd-1", "--peer-urls", "https://127.0.0.1:9", *common)
    assert r.returncode == 1 and "exists already" in r.stderr, r.stderr

    issue(cert_dir, "etcd", "etcd-4")
    base = tmp_base / "etcd-members" / "etcd-4"
    own = bundle(cert_dir, base / "certs", "etcd", "etcd-4")
    cp, pp = free_port(), free_port()
    r = cli(
        "cluster",
        "etcd",
        "member",
        "add",
        "etcd-4",
        "--peer-urls",
        f"https://127.0.0.1:{pp}",
        "-o",
        "json",
        *common,
    )
    assert r.returncode == 0, r.stderr
    added = json.loads(r.stdout)
    settings = added["settings"]
    assert settings["ETCD_INITIAL_CLUSTER_STATE"] == "existing"
    assert f"etcd-4=https://127.0.0.1:{pp}" in settings["ETCD_INITIAL_CLUSTER"].split(",")
    assert len(settings["ETCD_INITIAL_CLUSTER"].split(",")) == 4
    (base / "data").mkdir(parents=True, exist_ok=True)
    argv = member_argv(
        "etcd-4",
        "127.0.0.1",
        (cp, pp),
        base / "data",
        own,
        settings["ETCD_INITIAL_CLUSTER"],
        state="existing",
    )
    proc = ManagedProcess("etcd-4", argv, base / "etcd.log", env={"ETCD_UNSUPPORTED_ARCH": ""})
    proc.start()
    try:
        wait_for(
            lambda: (m := members(cli, eps, cert_dir).get("etcd-4")) is not None and m["healthy"],
            60,
            "etcd-4 to join and be healthy",
        )
        found = members(cli, eps, cert_dir)
        assert len(found) == 4 and all(m["healthy"] for m in found.values()), found
        assert found["etcd-4"]["id"] == added["member"]["id"]
        # the new member serves the replicas' data
        assert asyncio.run(_put_get(cert_dir, (f"https://127.0.0.1:{cp}",), "/kunlun/test/members/joined"))

        r = cli("cluster", "etcd", "member", "remove", "etcd-4", "-o", "json", *common)
        assert r.returncode == 0, r.stderr
        assert sorted(m["name"] for m in json.loads(r.stdout)["items"]) == ["etcd-1", "etcd-2", "etcd-3"]
        wait_for(lambda: not proc.alive(), 30, "the removed member to stop by itself")
    finally:
        proc.stop()
    found = members(cli, eps, cert_dir)
    assert sorted(found) == ["etcd-1", "etcd-2", "etcd-3"]
    assert all(m["healthy"] for m in found.values()), found
    assert asyncio.run(_put_get(cert_dir, eps, "/kunlun/test/members/after"))
    r = cli("cluster", "etcd", "member", "remove", "etcd-4", *common)
    assert r.returncode == 1 and "no etcd member named 'etcd-4'" in r.stderr, r.stderr


async def _put_get(cert_dir: Path, eps: tuple[str, ...], key: str) -> bool:
    s = EtcdStore(store_settings(cert_dir, eps))
    try:
        await s.put(key, b"ok")
        got = await s.get(key)
        return got is not None and got.value == b"ok"
    finally:
        await s.close()
