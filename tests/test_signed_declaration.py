"""Signed device declarations: `declaration sign|verify`, and an agent that refuses an unsigned or
changed declaration when started with --require-signed-config, naming the file."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.modelpkg_helpers import cli, make_keys

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def decl(tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    """(declaration, private key, trusted-keys folder, an untrusted private key)."""
    f = tmp_path / "device-plugin-config.yaml"
    shutil.copy(ROOT / "deploy" / "examples" / "node-a.yaml", f)
    priv, pub, _ = make_keys(tmp_path / "keys", "ops")
    trust = tmp_path / "trusted"
    trust.mkdir()
    shutil.copy(pub, trust / "ops.pub")
    other, _, _ = make_keys(tmp_path / "other", "mallory")
    return f, priv, trust, other


def agent(config: Path, trust: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "node_agent.main", "--config", str(config), "--endpoints", "127.0.0.1:9",
        "--cert-dir", str(tmp / "no-certs"), "--state-dir", str(tmp / "state"),
        "--require-signed-config", "--trusted-keys", str(trust),
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_sign_and_verify_a_declaration(decl: tuple[Path, Path, Path, Path], tmp_path: Path) -> None:
    f, priv, trust, other = decl
    r = cli("declaration", "verify", str(f), "--trust-dir", str(trust), home=tmp_path)
    assert r.returncode == 3 and f"{f} is unsigned (no device-plugin-config.yaml.sig" in r.stderr
    r = cli("declaration", "sign", str(f), "--sign-key", str(priv), home=tmp_path)
    assert r.returncode == 0 and (tmp_path / "device-plugin-config.yaml.sig").exists(), r.stderr
    r = cli("declaration", "verify", str(f), "--trust-dir", str(trust), home=tmp_path)
    assert r.returncode == 0 and "signed by trusted key ed25519:" in r.stdout, r.stderr
    f.write_text(f.read_text().replace("hbm_memory_mb: 32768", "hbm_memory_mb: 65536"))
    r = cli("declaration", "verify", str(f), "--trust-dir", str(trust), home=tmp_path)
    assert r.returncode == 3 and f"{f} changed since it was signed" in r.stderr
    cli("declaration", "sign", str(f), "--sign-key", str(other), home=tmp_path)
    r = cli("declaration", "verify", str(f), "--trust-dir", str(trust), home=tmp_path)
    assert r.returncode == 3 and "untrusted key" in r.stderr and str(f) in r.stderr


def test_agent_refuses_unsigned_or_changed_declaration(
    decl: tuple[Path, Path, Path, Path], tmp_path: Path
) -> None:
    f, priv, trust, _ = decl
    r = agent(f, trust, tmp_path)
    assert r.returncode == 2
    assert f"refusing the device declaration: {f} is unsigned" in r.stderr
    assert cli("declaration", "sign", str(f), "--sign-key", str(priv), home=tmp_path).returncode == 0
    # Signed: the declaration is accepted and start-up goes on to the next step (the certificates).
    r = agent(f, trust, tmp_path)
    assert r.returncode == 2 and "refusing the device declaration" not in r.stderr
    assert "no-certs" in r.stderr
    with f.open("a") as out:
        out.write("# one more line\n")
    r = agent(f, trust, tmp_path)
    assert r.returncode == 2 and f"{f} changed since it was signed" in r.stderr
