"""Fixtures: a real 3-member TLS etcd cluster, certificates, stores and whole local clusters."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from controlplane.store import EtcdStore, StoreSettings
from controlplane.store.admin import enable_etcd_auth
from devcluster.cluster import ClusterSpec, LocalCluster
from devcluster.etcd_cluster import EtcdCluster, build_etcd_cluster
from devcluster.procs import wait_for
from kunlun_common.pki import ClusterCerts, etcd_client_paths, init_cluster_certs

FAST_TMP = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@pytest.fixture(scope="session")
def tmp_base() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kunlun-test-", dir=FAST_TMP))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def bundle_dir() -> Iterator[Path]:
    """The offline bundle built from this checkout (`make dist`'s code path), once per session:
    tests/test_installer.py and tests/test_multihost_install.py install from it."""
    from kunlun_installer.bundle import build

    out = Path(tempfile.mkdtemp(prefix="kunlun-dist-"))
    try:
        yield build(Path(__file__).resolve().parent.parent, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="session")
def cert_dir(tmp_base: Path) -> Path:
    d = tmp_base / "certs"
    init_cluster_certs(d, ClusterCerts(nodes=("node-a", "node-b", "node-c", "node-x")))
    return d


def store_settings(cert_dir: Path, endpoints: tuple[str, ...], **kw: float) -> StoreSettings:
    p = etcd_client_paths(cert_dir)
    return StoreSettings(endpoints, str(p.ca), str(p.cert), str(p.key), **kw)  # type: ignore[arg-type]


def _etcd_ready(cert_dir: Path, endpoints: tuple[str, ...]) -> bool:
    async def check() -> bool:
        s = EtcdStore(store_settings(cert_dir, endpoints, request_timeout_s=2.0, retry_deadline_s=2.0))
        try:
            await s.revision()
            return True
        finally:
            await s.close()

    return asyncio.run(check())


@pytest.fixture(scope="session")
def etcd(tmp_base: Path, cert_dir: Path) -> Iterator[EtcdCluster]:
    """A real 3-member etcd cluster with client and peer TLS, shared by the store tests."""
    cluster = build_etcd_cluster(tmp_base / "etcd", cert_dir)
    cluster.start()
    try:
        wait_for(lambda: _etcd_ready(cert_dir, cluster.endpoints), 60, "etcd cluster")
        enable_etcd_auth(cluster.endpoints, cert_dir)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
async def store(etcd: EtcdCluster, cert_dir: Path) -> AsyncIterator[EtcdStore]:
    s = EtcdStore(store_settings(cert_dir, etcd.endpoints, watch_idle_timeout_s=8.0))
    await s.connect()
    yield s
    await s.close()


@pytest.fixture
def prefix() -> str:
    """A key prefix of this test's own (under the cluster prefix that etcd's `kunlun` role may use)."""
    return f"/kunlun/test/{uuid.uuid4().hex[:12]}/"


@pytest.fixture(autouse=True)
async def no_leaked_tasks() -> AsyncIterator[None]:
    """Fail a test that leaves asyncio tasks running."""
    before = set(asyncio.all_tasks())
    yield
    await asyncio.sleep(0)
    leaked = [
        t for t in asyncio.all_tasks() if t not in before and not t.done() and t is not asyncio.current_task()
    ]
    for _ in range(20):
        if not leaked:
            break
        await asyncio.sleep(0.05)
        leaked = [t for t in leaked if not t.done()]
    assert not leaked, f"leaked asyncio tasks: {[t.get_name() for t in leaked]}"


MARKERS = {
    "unit": "no etcd, no cluster, no root, no processes started: runs in seconds (`pytest -m unit`)",
    "etcd": "uses the shared real 3-member TLS etcd (the `etcd` fixture, or `store` on it)",
    "cluster": "uses a whole local cluster (a fixture named `*cluster`): replicas, agents, etcd",
    "root": "needs root (cgroups, namespaces); skipped elsewhere",
    "process": "starts real processes (engines, gateways, supervisors, vendor tools) without a cluster",
}
"""Applied by `pytest_collection_modifyitems` from what a test uses; registered in pyproject.toml."""

PROCESS_MODULES = (
    "subprocess",
    "devcluster.procs",
    "tests.test_gateway_support",
    "node_agent.executor.supervisor",
    "node_agent.executor.supervisor_api",
    "node_agent.executor.manager",
    "node_agent.executor.instance",
    "node_agent.executor.sandbox",
    "node_agent.plugins.host",
    "node_agent.plugins.remote",
    "node_agent.plugins.vendor_plugin",
    "node_agent.devices",
    "chaos",
)
"""A test module that imports from one of these (or a submodule) starts processes."""


def _starts_processes(module: object) -> bool:
    for value in vars(module).values():
        name = value.__name__ if isinstance(value, type(os)) else getattr(value, "__module__", None)
        if isinstance(name, str) and any(name == m or name.startswith(m + ".") for m in PROCESS_MODULES):
            return True
    return False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test by the fixtures it uses (transitively) and what its module starts."""
    starts: dict[object, bool] = {}
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        kinds = set()
        if "etcd" in used:
            kinds.add("etcd")
        if any(name.endswith("cluster") for name in used):
            kinds.add("cluster")
        if any("needs root" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")):
            kinds.add("root")
        module = getattr(item, "module", None)
        if module is not None and module not in starts:
            starts[module] = _starts_processes(module)
        if not kinds and starts.get(module):
            kinds.add("process")
        for kind in kinds or {"unit"}:
            item.add_marker(getattr(pytest.mark, kind))


def start_cluster(base: Path, **kw: object) -> LocalCluster:
    cluster = LocalCluster(ClusterSpec(base_dir=base, **kw))  # type: ignore[arg-type]
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster


LOG_KEEP = Path(tempfile.gettempdir()) / "kunlun-test-logs"


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    """A whole local cluster (3 etcd members, 3 replicas, 2 agents) for one test module.

    Its process logs are kept under $TMPDIR/kunlun-test-logs/<module>/ for post-mortems.
    """
    base = Path(tempfile.mkdtemp(prefix="kunlun-cluster-", dir=FAST_TMP))
    c = start_cluster(base, extra_nodes=("node-x", "node-c"))
    try:
        yield c
    finally:
        c.stop()
        keep = LOG_KEEP / request.module.__name__.rsplit(".", 1)[-1]
        shutil.rmtree(keep, ignore_errors=True)
        for log in [*base.glob("replicas/*.log"), *base.glob("agents/*/agent.log")]:
            dest = keep / log.relative_to(base)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(log, dest)
        shutil.rmtree(base, ignore_errors=True)


def _log_tail(text: str, lines: int = 25) -> str:
    """The last `lines` lines of a process log that are not routine heartbeat chatter."""
    kept = [
        ln[:400] for ln in text.splitlines() if '"heartbeat' not in ln and "assignments received" not in ln
    ]
    return "\n".join(kept[-lines:])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """When a test on a local cluster fails, its report carries the tail of every replica's and
    agent's log: CI prints the report, and the cluster's folder is gone by the time anyone looks."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if not report.failed or call.when == "setup":
        return
    funcargs = getattr(item, "funcargs", {})
    for value in funcargs.values():
        if isinstance(value, LocalCluster):
            procs = [*value.replicas.items(), *value.agents.items()]
            for name, proc in procs:
                try:
                    tail = _log_tail(proc.log_text())
                except Exception as e:  # a post-mortem must never mask the failure itself
                    tail = f"(log unreadable: {e})"
                report.sections.append((f"log tail: {name}", tail))
            break
