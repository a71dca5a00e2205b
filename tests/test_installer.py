"""kunlun-installer against a real bundle built from this checkout (`make dist`'s code path).

One bundle is built per session (conftest's `bundle_dir`: the wheel of this tree and its pinned dependencies); hosts are
temporary folders standing for /opt/kunlun, /etc/kunlun, /etc/systemd/system and /var/lib/kunlun.
Each install builds a real virtual environment offline from the bundle's wheelhouse.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from devcluster.procs import free_port, wait_for
from kunlun_common.pki import ClusterCerts, init_cluster_certs, write_crl
from kunlun_installer import host
from kunlun_installer.bundle import Bundle, project_version, write_manifest
from kunlun_installer.units import ROLES, command_line, parse_unit

ROOT = Path(__file__).resolve().parent.parent
V = project_version(ROOT)
"""This tree's version (the bundle's)."""
V1 = V + ".post1"
"""The version the upgrade test builds beside it."""
FAST_TMP = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


@pytest.fixture(scope="module")
def certs() -> Iterator[Path]:
    """This host's certificate folder, as an operator would copy it: no CA private key."""
    d = Path(tempfile.mkdtemp(prefix="kunlun-certs-", dir=FAST_TMP))
    init_cluster_certs(d / "all", ClusterCerts(nodes=("node-a",)))
    host_dir = d / "host"
    shutil.copytree(d / "all", host_dir, ignore=shutil.ignore_patterns("ca.key"))
    yield host_dir
    shutil.rmtree(d, ignore_errors=True)


def installer(
    *args: str | Path, bundle: Path | None = None, paths: host.Paths
) -> subprocess.CompletedProcess[str]:
    """Run the installer the way an operator does from the bundle: from the wheel, no venv."""
    argv = [
        *map(str, args),
        "--prefix",
        str(paths.prefix),
        "--etc",
        str(paths.etc),
        "--unit-dir",
        str(paths.unit_dir),
        "--data",
        str(paths.data),
    ]
    if bundle is not None:
        wheel = next((bundle / "wheelhouse").glob("kunlun_platform-*.whl"))
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(wheel)}
        argv += ["--bundle", str(bundle)]
    else:
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "kunlun_installer", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def new_host(tmp: Path) -> host.Paths:
    return host.Paths(
        tmp / "opt" / "kunlun", tmp / "etc" / "kunlun", tmp / "etc" / "systemd", tmp / "var" / "kunlun"
    )


def replica_yaml(tmp: Path, certs: Path, extra: str = "") -> Path:
    p = tmp / "replica.yaml"
    p.write_text(
        "name: replica-1\n"
        f"cert_dir: {certs}\n"
        "listen: 127.0.0.1:50051\n"
        "etcd_endpoints: [https://127.0.0.1:2379]\n" + extra
    )
    return p


@pytest.fixture(scope="module")
def installed(bundle_dir: Path, certs: Path) -> Iterator[host.Paths]:
    tmp = Path(tempfile.mkdtemp(prefix="kunlun-host-", dir=FAST_TMP))
    paths = new_host(tmp)
    r = installer(
        "install", "--role", "control-plane", "--config", replica_yaml(tmp, certs), "--certs", certs,
        "--user", "root", bundle=bundle_dir, paths=paths,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    yield paths
    shutil.rmtree(tmp, ignore_errors=True)


def test_bundle_manifest_lists_every_file_and_catches_a_changed_byte(
    bundle_dir: Path, tmp_path: Path
) -> None:
    b = Bundle.open(bundle_dir)
    on_disk = {str(p.relative_to(bundle_dir)) for p in bundle_dir.rglob("*") if p.is_file()} - {
        "manifest.json"
    }
    assert set(b.files) == on_disk
    assert any(f.startswith("wheelhouse/grpcio-") for f in b.files), (
        "pinned dependencies travel in the bundle"
    )
    assert b.verify() == []
    copy = tmp_path / "bundle"
    shutil.copytree(bundle_dir, copy)
    unit = copy / "units" / "kunlun-platform.service"
    data = bytearray(unit.read_bytes())
    data[10] ^= 1
    unit.write_bytes(bytes(data))
    assert Bundle.open(copy).verify() == [
        "units/kunlun-platform.service: content differs from the manifest (SHA-256)"
    ]


def test_install_lays_out_release_config_certs_and_units(installed: host.Paths) -> None:
    paths = installed
    assert os.readlink(paths.prefix / "current") == f"releases/{V}"
    assert (paths.prefix / "current" / "venv" / "bin" / "kunlun-platform").exists()
    assert (paths.etc / "replica.yaml").stat().st_mode & 0o777 == 0o640
    keys = list((paths.etc / "certs").rglob("*.key"))
    assert keys and all(k.stat().st_mode & 0o777 == 0o640 for k in keys)
    assert not (paths.etc / "certs" / "ca.key").exists()
    unit = (paths.unit_dir / "kunlun-platform.service").read_text()
    assert (
        f"ExecStart={paths.prefix}/current/venv/bin/kunlun-platform --config {paths.etc}/replica.yaml" in unit
    )
    assert "@" not in unit.replace("@localhost", "")
    r = installer("verify", paths=paths)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok: every installed file as installed" in r.stdout
    # the installed release runs: its own CLI answers
    v = subprocess.run(
        [str(paths.prefix / "current/venv/bin/kunlun-cli"), "--help"], capture_output=True, text=True
    )
    assert v.returncode == 0 and "workload" in v.stdout


def test_install_twice_changes_nothing(installed: host.Paths, bundle_dir: Path, certs: Path) -> None:
    before = json.loads(installed.state_file.read_text())
    cfg = installed.etc.parent.parent / "replica.yaml"
    r = installer(
        "install", "--role", "control-plane", "--config", cfg, "--certs", certs, "--user", "root",
        bundle=bundle_dir, paths=installed,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "already present" in r.stdout and "units] unchanged" in r.stdout
    assert json.loads(installed.state_file.read_text())["files"] == before["files"]


def test_verify_names_damage_and_repair_restores_it(installed: host.Paths) -> None:
    paths = installed
    exe = paths.prefix / f"releases/{V}/venv/bin/kunlun-platform"
    exe.unlink()
    cfg = paths.etc / "replica.yaml"
    data = bytearray(cfg.read_bytes())
    data[0] ^= 0x20
    cfg.write_bytes(bytes(data))
    (paths.unit_dir / "kunlun-platform.service").unlink()
    r = installer("verify", paths=paths)
    assert r.returncode == 1
    assert f"missing: {exe}" in r.stdout
    assert f"changed: {cfg}" in r.stdout
    assert f"missing: {paths.unit_dir / 'kunlun-platform.service'}" in r.stdout
    r = installer("verify", "--repair", paths=paths)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"restored {cfg} (changed)" in r.stdout and "rebuilt" in r.stdout
    assert installer("verify", paths=paths).returncode == 0
    assert exe.exists() and cfg.read_bytes()[0] == ord("n")


def test_units_pass_systemd_analyze_verify(bundle_dir: Path, certs: Path, tmp_path: Path) -> None:
    """Every role's rendered unit, with the hardening directives, is clean for systemd itself."""
    paths = new_host(tmp_path)
    state: dict[str, object] = {"files": {}}
    rel = tmp_path / "rel"
    shutil.copytree(bundle_dir / "units", rel / "bundle" / "units")
    venv_bin = paths.prefix / "current" / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    for exe in ("kunlun-platform", "kunlun-agent", "kunlun-gateway"):
        (venv_bin / exe).write_text("#!/bin/sh\n")
        (venv_bin / exe).chmod(0o755)
    host.render_units(paths, state, rel, list(ROLES), "root")
    units = sorted(paths.unit_dir.glob("*.service"))
    assert [u.name for u in units] == sorted(u for u, _ in ROLES.values())
    r = subprocess.run(
        ["systemd-analyze", "verify", *map(str, units)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr
    agent = (paths.unit_dir / "kunlun-agent.service").read_text()
    assert "KillMode=process" in agent and "Delegate=yes" in agent
    assert "NoNewPrivileges=true" in (paths.unit_dir / "kunlun-platform.service").read_text()
    etcd = (paths.unit_dir / "kunlun-etcd.service").read_text()
    assert f"--client-crl-file={paths.etc}/certs/crl/etcd.crl" in etcd
    # a broken directive is caught by the same check (so the check can fail)
    bad = paths.unit_dir / "kunlun-platform.service"
    bad.write_text(bad.read_text().replace("ProtectSystem=strict", "ProtectSystem=sometimes"))
    r = subprocess.run(["systemd-analyze", "verify", str(bad)], capture_output=True, text=True, timeout=60)
    assert "Failed to parse protect system value" in r.stderr


def test_bad_config_is_refused_naming_step_file_and_field(
    installed: host.Paths, bundle_dir: Path, certs: Path
) -> None:
    cfg = installed.etc.parent.parent / "bad-gateway.yaml"
    cfg.write_text("name: gateway-1\nlisten: 127.0.0.1:8080\nrequire_api_kye: true\n")
    r = installer(
        "install", "--role", "gateway", "--config", cfg, "--certs", certs, "--user", "root",
        bundle=bundle_dir, paths=installed,
    )  # fmt: skip
    assert r.returncode == 2
    assert "step 'check config' failed" in r.stderr and str(cfg) in r.stderr and "require_api_kye" in r.stderr
    assert not (installed.etc / "gateway.yaml").exists(), "nothing is configured from a refused file"
    assert not (installed.unit_dir / "kunlun-gateway.service").exists()


def test_a_ca_private_key_never_reaches_a_host(bundle_dir: Path, certs: Path, tmp_path: Path) -> None:
    paths = new_host(tmp_path)
    with_key = tmp_path / "certs"
    shutil.copytree(certs, with_key)
    (with_key / "replica-ca.key").write_text("secret")
    r = installer(
        "install", "--role", "control-plane", "--config", replica_yaml(tmp_path, certs), "--certs", with_key,
        "--user", "root", bundle=bundle_dir, paths=paths,
    )  # fmt: skip
    assert r.returncode == 2 and "a CA private key" in r.stderr
    assert not paths.etc.exists() and not paths.prefix.exists(), "refused before anything was laid out"


def test_etcd_unit_passes_a_crl_signed_by_the_etcd_ca(
    installed: host.Paths, bundle_dir: Path, certs: Path, tmp_path: Path
) -> None:
    """`--role etcd`: the unit starts etcd with --client-crl-file, and the file it names is installed
    and is a CRL signed by the etcd CA; a folder without the CRL, or with another CA's, is refused."""
    from cryptography import x509

    env = ROOT / "deploy" / "examples" / "etcd.env"

    def install_etcd(cert_dir: Path) -> subprocess.CompletedProcess[str]:
        return installer(
            "install", "--role", "etcd", "--config", env, "--certs", cert_dir, "--user", "root",
            bundle=bundle_dir, paths=installed,
        )  # fmt: skip

    no_crl = tmp_path / "no-crl"
    shutil.copytree(certs, no_crl, ignore=shutil.ignore_patterns("crl"))
    r = install_etcd(no_crl)
    assert r.returncode == 2 and "step 'certificates' failed" in r.stderr, r.stdout + r.stderr
    assert f"{no_crl}/crl/etcd.crl: missing" in r.stderr
    foreign = tmp_path / "foreign"
    init_cluster_certs(foreign, ClusterCerts(nodes=("node-a",)))
    wrong = tmp_path / "wrong-crl"
    shutil.copytree(certs, wrong)
    shutil.copyfile(foreign / "crl" / "etcd.crl", wrong / "crl" / "etcd.crl")
    r = install_etcd(wrong)
    assert r.returncode == 2 and "not signed by the CA" in r.stderr, r.stdout + r.stderr
    assert not (installed.unit_dir / "kunlun-etcd.service").exists(), (
        "nothing installed from a refused folder"
    )

    r = install_etcd(certs)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "CRL signed by the etcd CA, 0 revoked serial(s)" in r.stdout
    argv, _ = command_line(parse_unit(installed.unit_dir / "kunlun-etcd.service"))
    flags = [a for a in argv if a.startswith("--client-crl-file=")]
    assert flags == [f"--client-crl-file={installed.etc}/certs/crl/etcd.crl"], argv
    crl = x509.load_der_x509_crl(Path(flags[0].partition("=")[2]).read_bytes())
    ca = x509.load_pem_x509_certificate((installed.etc / "certs" / "etcd-ca.crt").read_bytes())
    assert crl.issuer == ca.subject and crl.is_signature_valid(ca.public_key())  # type: ignore[arg-type]
    assert len(list(crl)) == 0
    assert installer("verify", paths=installed).returncode == 0
    # after `certs revoke --dir` the operator copies a newer CRL there: verify does not flag it
    write_crl(certs.parent / "all", [12345])
    shutil.copyfile(certs.parent / "all" / "crl" / "etcd.crl", installed.etc / "certs" / "crl" / "etcd.crl")
    r = installer("verify", paths=installed)
    assert r.returncode == 0, r.stdout + r.stderr


def answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1.0) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def test_run_mode_starts_the_units_command_line_and_stops_it(
    bundle_dir: Path, certs: Path, tmp_path: Path
) -> None:
    """A gateway host, installed from the bundle, started with its unit's exact command line."""
    paths = new_host(tmp_path)
    port = free_port()
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(f"name: gateway-1\nlisten: 127.0.0.1:{port}\nstatic_endpoints: ['chat=127.0.0.1:9']\n")
    r = installer(
        "install", "--role", "gateway", "--config", cfg, "--certs", certs, "--user", "root",
        bundle=bundle_dir, paths=paths,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    argv, _ = command_line(parse_unit(paths.unit_dir / "kunlun-gateway.service"))
    assert argv[0] == f"{paths.prefix}/current/venv/bin/kunlun-gateway"
    runner = subprocess.Popen(
        [sys.executable, "-m", "kunlun_installer", "run", "--role", "gateway", "--prefix", str(paths.prefix), "--etc", str(paths.etc),
         "--unit-dir", str(paths.unit_dir), "--data", str(paths.data)],
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: answers(port), 60, "the gateway started by `kunlun-installer run`")
        assert (paths.data / "log" / "kunlun-gateway.log").exists()
    finally:
        runner.send_signal(signal.SIGTERM)
        out, _ = runner.communicate(timeout=60)
    assert runner.returncode == 0, out
    assert "kunlun-gateway.service stopped" in out
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and answers(port):
        time.sleep(0.1)
    assert not answers(port), "the gateway is gone after the runner stopped"


def test_upgrade_switches_release_and_rollback_returns(
    installed: host.Paths, bundle_dir: Path, tmp_path: Path
) -> None:
    """Version N+1 (this tree with its version bumped) installs beside N; rollback returns to N."""
    r = installer("rollback", paths=installed)
    assert r.returncode == 2 and "no previous release" in r.stderr
    repo = tmp_path / "repo"
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
    )
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(*skip))
    pyproject = repo / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace(f'version = "{V}"', f'version = "{V1}"', 1))
    new = tmp_path / f"kunlun-{V1}"
    shutil.copytree(bundle_dir, new)
    for old in (new / "wheelhouse").glob("kunlun_platform-*.whl"):
        old.unlink()
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(new / "wheelhouse"),
         str(repo)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    write_manifest(new, V1)
    # staged first: the release built and checked beside the current one, nothing switched
    r = installer("upgrade", "--stage", bundle=new, paths=installed)
    assert r.returncode == 0 and f"{V1} staged" in r.stdout, r.stdout + r.stderr
    assert os.readlink(installed.prefix / "current") == f"releases/{V}"
    assert (installed.prefix / f"releases/{V1}/.complete").exists()
    assert json.loads(installed.state_file.read_text())["current"] == V
    r = installer("upgrade", bundle=new, paths=installed)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "already present" in r.stdout, "the staged release is switched to, not built again"
    assert os.readlink(installed.prefix / "current") == f"releases/{V1}"
    state = json.loads(installed.state_file.read_text())
    assert (state["current"], state["previous"]) == (V1, V)
    version = subprocess.run(
        [str(installed.prefix / "current/venv/bin/python"), "-c",
         "import importlib.metadata as m; print(m.version('kunlun-platform'))"],
        capture_output=True, text=True, cwd=tmp_path,  # not the checkout: its egg-info may say another version
    )  # fmt: skip
    assert version.stdout.strip() == V1, version.stderr
    assert installer("verify", paths=installed).returncode == 0
    r = installer("rollback", paths=installed)
    assert r.returncode == 0, r.stderr
    assert os.readlink(installed.prefix / "current") == f"releases/{V}"
    assert (installed.prefix / f"releases/{V1}/venv").exists(), "the newer release stays for a roll-forward"
    assert installer("verify", paths=installed).returncode == 0


def test_uninstall_keeps_config_and_data_unless_purged(installed: host.Paths) -> None:
    """Last in this module: it removes the shared host's install."""
    paths = installed
    assert installer("uninstall", paths=paths).returncode == 0
    assert not paths.prefix.exists() and not (paths.unit_dir / "kunlun-platform.service").exists()
    assert not (paths.unit_dir / "kunlun-gateway.service").exists()
    assert (paths.etc / "replica.yaml").exists() and paths.data.exists()
    assert installer("uninstall", "--purge", paths=paths).returncode == 0
    assert not paths.etc.exists() and not paths.data.exists()


def test_a_missing_unit_is_named_with_the_fix(tmp_path: Path) -> None:
    """`run` on a host whose unit was removed stops at 'read unit' and says how to repair."""
    from kunlun_installer.errors import InstallError

    with pytest.raises(InstallError) as e:
        parse_unit(tmp_path / "kunlun-gateway.service")
    assert "read unit" in str(e.value) and "verify --repair" in str(e.value)
    assert f"{tmp_path / 'kunlun-gateway.service'}: missing" in str(e.value)
