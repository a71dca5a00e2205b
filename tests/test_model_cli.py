"""`kunlun-cli model keygen|pack|verify|inspect` as a user runs them: real processes, real files.

Every kind of tampering is refused with its exit code and a message naming what is wrong, and memory
stays bounded while a multi-GB (sparse) model is packed and verified.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.modelpkg_helpers import add_sparse_safetensors, cli, make_keys, make_model

CLI = [sys.executable, "-m", "controlplane.cli.main"]


def cli_process(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home)}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, env=env)


# Linux carries a process's peak RSS across fork and exec (the forked copy of the parent counts),
# so a CLI started straight from a long pytest run "peaks" at pytest's own size (336 MiB seen in CI).
# A small launcher process starts it instead and reports the CLI's own peak.
_RSS_LAUNCHER = """
import os, subprocess, sys
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(p.pid, 0)
print(usage.ru_maxrss)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def cli_rss(*args: str, home: Path) -> tuple[int, int, str]:
    """(exit code, peak RSS in MiB, stderr) of one CLI run."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home)}
    p = subprocess.run(
        [sys.executable, "-c", _RSS_LAUNCHER, *CLI, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    return p.returncode, int(p.stdout.split()[-1]) // 1024, p.stderr


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, Path]:
    """(home, package, private key, public key): a signed package of a small real model."""
    base = tmp_path_factory.mktemp("cli")
    model = make_model(base / "qwen-tiny")
    r = cli("model", "keygen", "--name", "release", "--dir", str(base / "keys"), "-o", "json", home=base)
    assert r.returncode == 0, r.stderr
    keys = json.loads(r.stdout)
    pkg = base / "qwen-tiny.kunlunpkg"
    r = cli(
        "model", "pack", "--model", str(model), "--out", str(pkg), "--quantize", "int8",
        "--target-device", "ascend:0", "--sign-key", keys["private_key"], home=base,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "writing   100%" in r.stderr and keys["key_id"] in r.stdout
    return base, pkg, Path(keys["private_key"]), Path(keys["public_key"])


def verify(pkg: Path, pub: Path, home: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return cli(
        "model", "verify", "--package", str(pkg), "--trusted-key", str(pub), "--quiet", *extra, home=home
    )


def rebuild(src: Path, dst: Path, change: Callable[[str, bytes], list[tuple[str, bytes]]]) -> None:
    """Copy a package member by member, letting `change` replace, drop or add members."""
    with tarfile.open(src) as tin, tarfile.open(dst, "w", format=tarfile.PAX_FORMAT) as tout:
        for m in tin.getmembers():
            f = tin.extractfile(m)
            assert f is not None
            for name, data in change(m.name, f.read()):
                ti = tarfile.TarInfo(name)
                ti.size = len(data)
                tout.addfile(ti, io.BytesIO(data))


def test_verify_and_inspect_a_good_package(signed: tuple[Path, Path, Path, Path]) -> None:
    home, pkg, _, pub = signed
    r = verify(pkg, pub, home, "-o", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] and doc["files"] == 3 and doc["signed_by"].startswith("ed25519:")
    r = cli("model", "inspect", str(pkg), "-o", "json", home=home)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["digest"] == doc["digest"] and info["quantization"] == "int8"
    assert info["weight_format"] == "safetensors" and info["target_device_types"] == ["ascend"]
    assert info["min_device_memory_mb"] > 512
    r = cli("model", "inspect", str(pkg), home=home)
    assert "Min memory" in r.stdout and "LlamaForCausalLM" in r.stdout
    # Keys trusted through the default folder (~/.config/kunlun/trusted-keys) count too.
    trust = home / ".config" / "kunlun" / "trusted-keys"
    trust.mkdir(parents=True, exist_ok=True)
    (trust / "release.pub").write_bytes(pub.read_bytes())
    r = cli("model", "verify", "--package", str(pkg), home=home)
    assert r.returncode == 0 and r.stdout.startswith("OK qwen-tiny@sha256:"), r.stderr
    (trust / "release.pub").unlink()


def test_flipped_bit_names_the_file(signed: tuple[Path, Path, Path, Path], tmp_path: Path) -> None:
    home, pkg, _, pub = signed
    bad = tmp_path / "bad.kunlunpkg"
    bad.write_bytes(pkg.read_bytes())
    with tarfile.open(pkg) as t:
        off = t.getmember("model/model.safetensors").offset_data + 123_456
    with bad.open("r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x01]))
    r = cli_process("model", "verify", "--package", str(bad), "--trusted-key", str(pub), home=home)
    assert r.returncode == 4, r.stderr
    assert "model/model.safetensors: SHA-256" in r.stderr and "changed after packing" in r.stderr


@pytest.mark.parametrize(
    "case,code,message",
    [
        ("added", 4, "model/extra.py: is not in the manifest (added after packing)"),
        ("removed", 4, "model/tokenizer.json: listed in the manifest but missing from the package (removed)"),
        ("manifest-edited", 3, "the manifest was changed after signing"),
        ("reordered", 2, "the first member is 'manifest.sig', expected manifest.json"),
        ("symlink", 2, "is not a regular file"),
    ],
)
def test_tampered_packages_are_refused(
    signed: tuple[Path, Path, Path, Path], tmp_path: Path, case: str, code: int, message: str
) -> None:
    home, pkg, _, pub = signed
    bad = tmp_path / f"{case}.kunlunpkg"

    def change(name: str, data: bytes) -> list[tuple[str, bytes]]:
        if case == "added" and name == "model/tokenizer.json":
            return [(name, data), ("model/extra.py", b"import os; os.system('evil')\n")]
        if case == "removed" and name == "model/tokenizer.json":
            return []
        if case == "manifest-edited" and name == "manifest.json":
            doc = json.loads(data)
            doc["min_device_memory_mb"] = 1
            return [(name, json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())]
        if case == "reordered" and name == "manifest.json":
            return []
        if case == "reordered" and name == "manifest.sig":
            with tarfile.open(pkg) as t:
                f = t.extractfile("manifest.json")
                assert f is not None
                return [(name, data), ("manifest.json", f.read())]
        return [(name, data)]

    if case == "symlink":
        rebuild(pkg, bad, lambda n, d: [(n, d)])
        with tarfile.open(bad, "a", format=tarfile.PAX_FORMAT) as t:
            ti = tarfile.TarInfo("model/link")
            ti.type, ti.linkname = tarfile.SYMTYPE, "/etc/shadow"
            t.addfile(ti)
    else:
        rebuild(pkg, bad, change)
    r = verify(bad, pub, home)
    assert r.returncode == code, r.stderr
    assert message in r.stderr


def test_untrusted_unsigned_and_truncated_are_refused(
    signed: tuple[Path, Path, Path, Path], tmp_path: Path
) -> None:
    home, pkg, _, pub = signed
    other_priv, other_pub, other_kid = make_keys(tmp_path / "other", "mallory")
    model = make_model(tmp_path / "m2")
    by_other = tmp_path / "other.kunlunpkg"
    r = cli(
        "model",
        "pack",
        "--model",
        str(model),
        "--out",
        str(by_other),
        "--sign-key",
        str(other_priv),
        home=home,
    )
    assert r.returncode == 0, r.stderr
    r = verify(by_other, pub, home)
    assert r.returncode == 3 and f"untrusted key {other_kid}" in r.stderr
    # A good signature by an untrusted key stays refused even when unsigned packages are allowed.
    assert verify(by_other, pub, home, "--allow-unsigned").returncode == 3
    assert verify(by_other, other_pub, home).returncode == 0

    unsigned = tmp_path / "unsigned.kunlunpkg"
    r = cli("model", "pack", "--model", str(model), "--out", str(unsigned), "--quiet", home=home)
    assert r.returncode == 0 and "UNSIGNED" in r.stdout
    r = verify(unsigned, pub, home)
    assert r.returncode == 3 and "package is unsigned" in r.stderr
    assert verify(unsigned, pub, home, "--allow-unsigned").returncode == 0

    data = pkg.read_bytes()
    for cut in (
        len(data) // 2,
        700,
        len(data) - 1024,
    ):  # inside a file, inside manifest.sig, before the end marker
        short = tmp_path / f"short-{cut}.kunlunpkg"
        short.write_bytes(data[:cut])
        r = verify(short, pub, home)
        assert r.returncode == 2, (cut, r.stderr)
        assert "truncated" in r.stderr
    (tmp_path / "junk.kunlunpkg").write_bytes(os.urandom(4096))
    r = verify(tmp_path / "junk.kunlunpkg", pub, home)
    assert r.returncode == 2 and "not a package" in r.stderr
    r = verify(tmp_path / "absent.kunlunpkg", pub, home)
    assert r.returncode == 1 and "no such file" in r.stderr


def test_memory_stays_bounded_for_a_multi_gb_model(tmp_path: Path) -> None:
    """Pack and verify a 2 GiB model (sparse on disk): peak RSS like that of a 2 MB model."""
    small = make_model(tmp_path / "small")
    code, rss_small, err = cli_rss(
        "model", "pack", "--model", str(small), "--out", str(tmp_path / "s.kunlunpkg"), home=tmp_path
    )
    assert code == 0, err
    big = make_model(tmp_path / "big")
    add_sparse_safetensors(big, "model-00002-of-00002.safetensors", 2 << 30)
    pkg = tmp_path / "big.kunlunpkg"
    code, rss_pack, err = cli_rss("model", "pack", "--model", str(big), "--out", str(pkg), home=tmp_path)
    assert code == 0, err
    assert pkg.stat().st_size > 2 << 30
    assert pkg.stat().st_blocks * 512 < 64 << 20  # the zero run became a hole in the package too
    code, rss_verify, err = cli_rss(
        "model", "verify", "--package", str(pkg), "--allow-unsigned", home=tmp_path
    )
    assert code == 0, err
    print(f"peak RSS MiB: pack small {rss_small}, pack 2 GiB {rss_pack}, verify 2 GiB {rss_verify}")
    assert rss_pack < rss_small + 32 and rss_verify < rss_small + 32
    assert rss_pack < 256 and rss_verify < 256
