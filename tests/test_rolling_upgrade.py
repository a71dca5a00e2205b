"""Rolling upgrade of a whole running cluster under gateway traffic, with version skew, then one
host rolled back.

Version N is the last release of this repository (`deploy/RELEASES`: its version and commit; the tag
`v<version>` must point at the same commit where the clone has it), its bundle built from
`git archive <commit>` with N's own `make dist` code. Version N+1 is this working tree plus a test
patch: a field `skew_probe` added to every message of `proto/kunlun/v1/*.proto` (stubs regenerated,
every RPC message sent with it set, so N receives fields it does not know) and a version of its own.

Seven hosts (network + mount namespaces, tests/multihost.py): three control-plane hosts (etcd +
replica), two workers, two gateways, and the client. Everything installed from bundle N and started
with `kunlun-installer run`; a workload of four test-engine instances over both workers. The client
sends bounded traffic through both gateways over HTTPS with an API key, retrying a refused or failed
request once on the other gateway. N+1 is staged on every host at once (`upgrade --stage`); then the
control-plane hosts and the gateways, one at a time, run `kunlun-installer upgrade --restart` and must
serve N+1 before the next; no engine and no etcd member may be restarted. Finally one control-plane
host is rolled back to N (`kunlun-installer rollback --restart`): an N replica among N+1 replicas,
N agents and N+1 gateways. Requests failed after the retry: 0.

The workers stay at N (skew: N agents fed by N+1 replicas). Upgrading them is left out because it
fails on a loaded machine: the agent restart (old agent stopped, new one imported and registered)
took 10 to 13 s at a load average of 17 on 2 cores, longer than the engines' fence lease
(`disconnect_stop_s` 5 s + 1 s slack), so every engine of the worker fenced itself and was started
again (and one request failed on both gateways). See the report of issue 15.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from chaos.netns import available
from tests.multihost import (
    GATEWAY_PORT,
    Layout,
    Site,
    client_cli,
    client_requests,
    each,
    installed_site,
    nodes_ready,
    running_endpoints,
    wait_until,
)

WHY = available()
pytestmark = [
    pytest.mark.skipif(bool(WHY), reason=f"needs root and network namespaces: {WHY}"),
    pytest.mark.timeout(2400),
]

ROOT = Path(__file__).resolve().parent.parent
RELEASES = ROOT / "deploy" / "RELEASES"
PROBE_FIELD, PROBE_NUMBER = "skew_probe", 4242

LAYOUT = Layout(
    workers=(("worker-1", "node-a"), ("worker-2", "node-b")),
    gateways=("gw-1", "gw-2"),
    # the client's steady traffic must never meet the per-key rate limit
    gateway_settings=(("rate_limit_per_s", 1000), ("rate_limit_burst", 2000)),
)
ROLLED = (*LAYOUT.control, *LAYOUT.gateways)
"""The hosts upgraded one at a time (the workers stay at N: see the module docstring)."""
INSTANCES = 4
SPEC = f"""name: chat
model: chat
engine: test
devices_per_instance: 1
memory_per_device_mb: 1024
replicas: {INSTANCES}
"""


# ---------------------------------------------------------------------- the two releases
def release_n() -> tuple[str, str]:
    """(version, commit) of the last release: deploy/RELEASES, checked against its tag if present."""
    lines = [ln.split() for ln in RELEASES.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines and len(lines[-1]) == 2, f"{RELEASES}: expected lines 'VERSION COMMIT'"
    version, commit = lines[-1]
    have = subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True, text=True
    )
    if have.returncode != 0:
        pytest.fail(
            f"release {version}: commit {commit} (deploy/RELEASES) is not in this clone; "
            "fetch the full history (git fetch --unshallow --tags) to run the rolling-upgrade test"
        )
    tag = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "-q", "--verify", f"refs/tags/v{version}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if tag.returncode == 0:
        assert tag.stdout.strip() == commit, (
            f"tag v{version} is {tag.stdout.strip()}, {RELEASES} says {commit}"
        )
    return version, commit


def build_bundle(tree: Path, out: Path, wheelhouse: Path) -> Path:
    """The tree's own `make dist` code, offline: dependencies from the session bundle's wheelhouse."""
    code = (
        "import sys; from pathlib import Path; from kunlun_installer.bundle import build; "
        "build(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tree), str(out), str(wheelhouse)],
        cwd=tree,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tree), "HOME": "/root"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, f"bundle of {tree}:\n{r.stdout}{r.stderr}"
    bundles = [p for p in out.iterdir() if p.is_dir()]
    assert len(bundles) == 1, bundles
    return bundles[0]


PROBED = '''"""Test patch of the rolling-upgrade test: every RPC message sent with `skew_probe` set, so a
release without that field receives a field it does not know."""


def probed(cls):
    if "skew_probe" not in cls.DESCRIPTOR.fields_by_name:
        return cls.SerializeToString

    def serialize(message):
        copy = cls()
        copy.CopyFrom(message)
        copy.skew_probe = "n+1"
        return copy.SerializeToString()

    return serialize
'''


def patch_next(tree: Path, version: str) -> None:
    """N+1: a field added to every message (an unused number), stubs regenerated, every RPC message
    sent with it set, and its own version."""
    added = 0
    for proto in sorted((tree / "proto" / "kunlun" / "v1").glob("*.proto")):
        text = proto.read_text()
        assert f"= {PROBE_NUMBER};" not in text and PROBE_FIELD not in text, proto
        text, n = re.subn(
            r"^(\s*)message (\w+) \{\n",
            lambda m: f"{m.group(0)}{m.group(1)}  string {PROBE_FIELD} = {PROBE_NUMBER};\n",
            text,
            flags=re.MULTILINE,
        )
        added += n
        proto.write_text(text)
    assert added > 50, f"only {added} messages patched"
    r = subprocess.run(
        [sys.executable, "scripts/gen_proto.py"], cwd=tree, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (tree / "kunlun_common" / "skew_probe.py").write_text(PROBED)
    for stub in (tree / "kunlun_common" / "api").glob("*_pb2_grpc.py"):
        text = stub.read_text()
        text, n = re.subn(
            r"(request|response)_serializer=([\w.]+)\.SerializeToString", r"\1_serializer=_probed(\2)", text
        )
        if n:
            stub.write_text("from kunlun_common.skew_probe import probed as _probed\n" + text)
    py = tree / "pyproject.toml"
    text, n = re.subn(
        r'^version = "[^"]+"', f'version = "{version}"', py.read_text(), count=1, flags=re.MULTILINE
    )
    assert n == 1
    py.write_text(text)


@dataclass(frozen=True)
class Releases:
    n: str
    n1: str
    bundle_n: Path
    bundle_n1: Path


@pytest.fixture(scope="module")
def releases(bundle_dir: Path) -> Iterator[Releases]:
    version, commit = release_n()
    work = Path(tempfile.mkdtemp(prefix="kunlun-releases-"))
    try:
        t0 = time.monotonic()
        src_n = work / "src-n"
        src_n.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(src_n)], input=archive.stdout, check=True)
        bundle_n = build_bundle(src_n, work / "dist-n", bundle_dir / "wheelhouse")
        skip = (
            ".venv",
            ".git",
            "dist",
            ".tools",
            ".cache",
            "*.egg-info",
            "__pycache__",
            ".mypy_cache",
            ".kunlun*",
            "build",
        )
        src_n1 = work / "src-n1"
        shutil.copytree(ROOT, src_n1, ignore=shutil.ignore_patterns(*skip))
        from kunlun_installer.bundle import project_version

        n1 = project_version(ROOT) + "+skew"
        patch_next(src_n1, n1)
        bundle_n1 = build_bundle(src_n1, work / "dist-n1", bundle_dir / "wheelhouse")
        print(
            f"[rolling] bundles N={version} ({commit[:10]}) and N+1={n1} built in {time.monotonic() - t0:.1f} s"
        )
        assert version != n1
        yield Releases(version, n1, bundle_n, bundle_n1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------- traffic
TRAFFIC = r"""
import http.client, json, os, ssl, sys, time
gateways, ca, key, model, out, stop_file = sys.argv[1].split(","), *sys.argv[2:7]
max_n, max_s, rate = int(sys.argv[7]), float(sys.argv[8]), float(sys.argv[9])
ctx = ssl.create_default_context(cafile=ca)
body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 4}).encode()
head = {"Authorization": "Bearer " + key, "Content-Type": "application/json"}
st = {"sent": 0, "ok": 0, "failed": 0, "retried": 0, "first_try_errors": {}, "failures": [], "done": False}

def once(gw):
    host, port = gw.rsplit(":", 1)
    c = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=10)
    try:
        c.request("POST", "/v1/completions", body=body, headers=head)
        r = c.getresponse()
        r.read()
        return r.status
    except (OSError, http.client.HTTPException) as e:
        return type(e).__name__
    finally:
        c.close()

def save():
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(st, f)
    os.replace(tmp, out)

start = time.monotonic()
last_save = 0.0
i = 0
while i < max_n and time.monotonic() - start < max_s and not os.path.exists(stop_file):
    t = time.monotonic()
    first = gateways[i % len(gateways)]
    other = gateways[(i + 1) % len(gateways)]
    st["sent"] += 1
    code = once(first)
    if code != 200:
        st["retried"] += 1
        k = f"{first} {code}"
        st["first_try_errors"][k] = st["first_try_errors"].get(k, 0) + 1
        code = once(other)
    if code == 200:
        st["ok"] += 1
    else:
        st["failed"] += 1
        st["failures"].append([round(t - start, 2), first, other, str(code)])
    i += 1
    if t - last_save > 0.5:
        save()
        last_save = t
    time.sleep(max(0.0, 1.0 / rate - (time.monotonic() - t)))
st["done"] = True
st["seconds"] = round(time.monotonic() - start, 1)
save()
"""


@dataclass
class Traffic:
    proc: subprocess.Popen[bytes]
    out: Path
    stop_file: Path

    def read(self) -> dict[str, object]:
        try:
            data: dict[str, object] = json.loads(self.out.read_text())
            return data
        except (FileNotFoundError, ValueError):
            return {}

    def ok(self) -> int:
        return int(str(self.read().get("ok", 0)))

    def stop(self) -> dict[str, object]:
        self.stop_file.write_text("stop\n")
        self.proc.wait(60)
        return self.read()


def start_traffic(site: Site, key: str) -> Traffic:
    d = site.hosts.root / "client"
    out, stop_file = d / "traffic.json", d / "traffic.stop"
    gws = ",".join(f"{site.addr(h)}:{GATEWAY_PORT}" for h in LAYOUT.gateways)
    argv = site.topo.exec_argv(
        "client",
        [sys.executable, "-c", TRAFFIC, gws, str(site.certs / "ca.crt"), key, "chat", str(out), str(stop_file),
         "100000", "1800", "10"],
    )  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=(d / "traffic.err").open("wb"))
    return Traffic(proc, out, stop_file)


# ---------------------------------------------------------------------- what each host runs
def replica_versions(site: Site) -> dict[str, tuple[str, int]]:
    st = site.cli("cluster", "status")
    reps = st.get("replicas") if st and st.get("leader") else None
    if not isinstance(reps, list):
        return {}
    return {str(r["address"]).rsplit(":", 1)[0]: (str(r["version"]), int(r["pid"])) for r in reps}


def agent_versions(site: Site) -> dict[str, tuple[str, int]]:
    out = site.cli("node", "list")
    items = out.get("items") if out else None
    if not isinstance(items, list):
        return {}
    return {
        str(n["name"]): (str(n["agent_version"]), int(n["pid"])) for n in items if n.get("status") == "Ready"
    }


def gateway_versions(site: Site) -> dict[str, tuple[str, int]]:
    out = site.cli("gateway", "list")
    items = out.get("items") if out else None
    if not isinstance(items, list):
        return {}
    return {str(g["name"]): (str(g["version"]), int(g["pid"])) for g in items}


def reported(site: Site, host: str) -> tuple[str, int] | None:
    """(version, pid) the host's process reports through the control plane."""
    if host in LAYOUT.control:
        return replica_versions(site).get(site.addr(host))
    workers = dict(LAYOUT.workers)
    if host in workers:
        return agent_versions(site).get(workers[host])
    return gateway_versions(site).get(LAYOUT.gateway_name(host))


def service_starts(site: Site, host: str) -> dict[str, int]:
    """How many times the host's runner started each unit (its `started (pid N, start #K)` lines)."""
    text = (site.hosts.dir(host) / "runner.log").read_text()
    out: dict[str, int] = {}
    for m in re.finditer(r"(kunlun-[\w-]+\.service) started \(pid \d+, start #(\d+)\)", text):
        out[m.group(1)] = int(m.group(2))
    return out


def engines(site: Site) -> dict[str, tuple[int, int]]:
    """instance id -> (supervisor pid, engine pid) from the workers' supervisor state files."""
    found: dict[str, tuple[int, int]] = {}
    for h, _ in LAYOUT.workers:
        for state in (site.hosts.dir(h) / "varlib" / "kunlun" / "agent").rglob("state.json"):
            try:
                s = json.loads(state.read_text())
            except ValueError:
                continue
            if s.get("status") in ("starting", "running") and s.get("engine_pid"):
                found[str(s["instance_id"])] = (int(s["supervisor_pid"]), int(s["engine_pid"]))
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}").exists() and "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


# ---------------------------------------------------------------------- the site
@pytest.fixture(scope="module")
def site(releases: Releases) -> Iterator[Site]:
    with installed_site(releases.bundle_n, LAYOUT, "10.215.0", "rolling-upgrade") as s:
        yield s


@pytest.fixture(scope="module")
def api_key(site: Site) -> str:
    wait_until(lambda: nodes_ready(site), 180, "node-a and node-b Ready", interval=2)
    created = site.cli("gateway", "keys", "create", "rolling")
    assert created is not None and created.get("secret")
    spec = site.hosts.root / "client" / "chat.yaml"
    spec.write_text(SPEC)
    r = client_cli(site.topo, site.client_config, "workload", "submit", "-f", str(spec))
    assert r.returncode == 0, r.stdout + r.stderr
    wait_until(
        lambda: len(running_endpoints(site, "chat")) == INSTANCES, 240, f"{INSTANCES} instances Running"
    )
    return str(created["secret"])


def test_every_host_upgraded_one_by_one_under_traffic_then_one_rolled_back(
    site: Site, releases: Releases, api_key: str
) -> None:
    n, n1 = releases.n, releases.n1
    eps = running_endpoints(site, "chat")
    assert {e.rsplit(":", 1)[0] for e in eps} == {site.addr(h) for h, _ in LAYOUT.workers}, eps
    for h in LAYOUT.hosts:
        wait_until(
            lambda h=h: (reported(site, h) or ("", 0))[0] == n, 120, f"{h} to report version {n}", interval=2
        )
    engines_before = wait_until(
        lambda: len(engines(site)) == INSTANCES and engines(site), 60, "engine states"
    )
    assert isinstance(engines_before, dict)
    starts_before = {h: service_starts(site, h) for h in LAYOUT.hosts}
    reported_before = {h: reported(site, h) for h in LAYOUT.hosts}
    traffic = start_traffic(site, api_key)
    try:
        wait_until(lambda: traffic.ok() >= 40, 60, "traffic through both gateways", interval=0.5)
        # N+1 staged on every host at once (its virtual environment built beside N, nothing switched):
        # the slow part, done while everything serves N
        t0 = time.monotonic()

        def stage(h: str) -> None:
            rc, out = site.installer(h, "upgrade", "--stage", bundle=releases.bundle_n1)
            assert rc == 0 and "staged" in out, f"upgrade --stage on {h}:\n{out}"

        each(ROLLED, stage)
        stage_s = time.monotonic() - t0
        print(f"[rolling] N+1 staged on {len(ROLLED)} hosts in {stage_s:.1f} s")
        assert all(reported(site, h) == starts for h, starts in reported_before.items()), (
            "staging restarted nothing"
        )
        upgrade_s: dict[str, float] = {}
        for h in ROLLED:
            before = reported(site, h)
            assert before is not None and before[0] == n, (h, before)
            ok_before = traffic.ok()
            t0 = time.monotonic()
            rc, out = site.installer(h, "upgrade", "--restart", bundle=releases.bundle_n1)
            assert rc == 0, f"upgrade on {h}:\n{out}"
            assert f"-> {n1}" in out, out
            wait_until(
                lambda h=h: (reported(site, h) or ("", 0))[0] == n1,
                120,
                f"{h} to report version {n1}",
                interval=1,
            )
            if h in dict(LAYOUT.workers):  # its engines adopted, every instance Running
                wait_until(
                    lambda: len(running_endpoints(site, "chat")) == INSTANCES,
                    60,
                    "every instance Running",
                    interval=1,
                )
            if h in LAYOUT.gateways:  # serving again: its own port answers the client
                wait_until(
                    lambda h=h: gateway_answers(site, h, api_key), 60, f"{h} to serve again", interval=0.5
                )
            upgrade_s[h] = time.monotonic() - t0
            after = reported(site, h)
            assert after is not None and after[1] != before[1], f"{h}: its process was not restarted"
            print(f"[rolling] {h}: upgraded {n} -> {n1} in {upgrade_s[h]:.1f} s; traffic {traffic.read()}")
            wait_until(
                lambda ok=ok_before: traffic.ok() >= ok + 10, 60, f"traffic to go on after {h}", interval=0.5
            )
        # every upgraded process reports N+1, no engine was restarted, etcd never was, each service once
        for h in LAYOUT.hosts:
            got = reported(site, h)
            assert got is not None and got[0] == (n1 if h in ROLLED else n), (h, got)
            starts = service_starts(site, h)
            for unit, k in starts_before[h].items():
                want = k if unit == "kunlun-etcd.service" or h not in ROLLED else k + 1
                assert starts[unit] == want, f"{h}: {unit} started {starts[unit]} times, expected {want}"
        assert engines(site) == engines_before, "an engine was restarted by the upgrade"
        assert all(alive(p) for pair in engines_before.values() for p in pair)
        # one control-plane host back to N: an N replica among N+1 replicas, N agents, N+1 gateways
        back = LAYOUT.control[1]
        before = reported(site, back)
        assert before is not None
        ok_before = traffic.ok()
        rc, out = site.installer(back, "rollback", "--restart", bundle=releases.bundle_n1)
        assert rc == 0 and f"{n1} -> {n}" in out, out
        wait_until(
            lambda: (reported(site, back) or ("", 0))[0] == n, 120, f"{back} to report {n} again", interval=1
        )
        after = reported(site, back)
        assert after is not None and after[1] != before[1]
        state = json.loads((site.hosts.dir(back) / "opt" / "kunlun" / "state" / "installed.json").read_text())
        assert (state["current"], state["previous"]) == (n, n1)
        wait_until(lambda: traffic.ok() >= ok_before + 40, 60, "traffic after the rollback", interval=0.5)
        assert engines(site) == engines_before, "an engine was restarted by the rollback"
        assert sorted(running_endpoints(site, "chat")) == sorted(eps)
    finally:
        result = traffic.stop()
    print(
        f"[rolling] traffic: {result.get('sent')} requests sent, {result.get('ok')} ok, "
        f"{result.get('failed')} failed after the retry, {result.get('retried')} retried on the other gateway "
        f"({result.get('first_try_errors')}) in {result.get('seconds')} s"
    )
    print(f"[rolling] upgrade seconds per host: {json.dumps({h: round(s, 1) for h, s in upgrade_s.items()})}")
    assert result.get("done") and result.get("failed") == 0, result


def gateway_answers(site: Site, host: str, key: str) -> bool:
    url = f"https://{site.addr(host)}:{GATEWAY_PORT}/v1/completions"
    return client_requests(site.topo, url, site.certs / "ca.crt", key, "chat", 1, deadline_s=10) == [200]
