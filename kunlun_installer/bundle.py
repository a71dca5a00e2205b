"""The offline release bundle: what `make dist` builds and what `kunlun-installer` installs from.

A bundle is a folder (also shipped as `kunlun-<version>-bundle.tar.gz`):

    manifest.json          name, version, python, and the SHA-256 and size of every other file
    wheelhouse/*.whl       the kunlun-platform wheel and every pinned dependency for the target Python,
                           and pip's own wheel (the installer runs pip from it: no ensurepip)
    units/*.service        systemd unit templates (@PREFIX@, @ETC@, @DATA@, @USER@, @ETCD@)
    examples/*             example configurations per role
    kunlun-installer       a shell entry point: runs the installer straight from the wheel

Installing needs no network: the installer is pure Python from the standard library, runnable from
the wheel itself (a wheel is a zip file Python can import from), and the virtual environment is
built with `pip install --no-index --find-links wheelhouse`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from kunlun_installer.errors import InstallError

MANIFEST = "manifest.json"
CHUNK = 1 << 20

ENTRY_POINT = """#!/bin/sh
# Runs kunlun-installer from this bundle's wheel (no network, no prior install needed).
here=$(cd "$(dirname "$0")" && pwd)
wheel=$(ls "$here"/wheelhouse/kunlun_platform-*.whl | head -n 1)
PYTHONPATH="$wheel" exec "${PYTHON:-python3}" -m kunlun_installer "$@" --bundle "$here"
"""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class Bundle:
    """A bundle folder whose manifest was read (not yet checked: see `verify`)."""

    root: Path
    name: str
    version: str
    python: str
    files: dict[str, dict[str, object]]

    @classmethod
    def open(cls, root: str | os.PathLike[str]) -> Bundle:
        base = Path(root).resolve()
        path = base / MANIFEST
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise InstallError(
                "read bundle", f"{path}: no manifest", "point --bundle at an unpacked kunlun bundle folder"
            ) from None
        except (OSError, ValueError) as e:
            raise InstallError(
                "read bundle", f"{path}: unreadable manifest ({e})", "rebuild it: make dist"
            ) from e
        for key in ("name", "version", "files"):
            if key not in data:
                raise InstallError("read bundle", f"{path}: field {key!r} missing", "rebuild it: make dist")
        return cls(
            base, str(data["name"]), str(data["version"]), str(data.get("python", "")), dict(data["files"])
        )

    def verify(self) -> list[str]:
        """Every problem with the bundle's files against its manifest (empty: intact)."""
        problems = []
        for rel, meta in sorted(self.files.items()):
            p = self.root / rel
            if not p.is_file():
                problems.append(f"{rel}: missing")
            elif p.stat().st_size != meta.get("size"):
                problems.append(f"{rel}: size {p.stat().st_size}, manifest says {meta.get('size')}")
            elif sha256_file(p) != meta.get("sha256"):
                problems.append(f"{rel}: content differs from the manifest (SHA-256)")
        return problems

    def wheel(self) -> Path:
        found = sorted((self.root / "wheelhouse").glob("kunlun_platform-*.whl"))
        if not found:
            raise InstallError(
                "read bundle", f"{self.root}/wheelhouse: no kunlun_platform wheel", "make dist"
            )
        return found[-1]


def write_manifest(root: Path, version: str) -> Path:
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            files[str(p.relative_to(root))] = {"sha256": sha256_file(p), "size": p.stat().st_size}
    manifest = {
        "name": "kunlun-platform",
        "version": version,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "created_unix": int(time.time()),
        "files": files,
    }
    out = root / MANIFEST
    out.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return out


def project_version(repo: Path) -> str:
    for line in (repo / "pyproject.toml").read_text().splitlines():
        if line.startswith("version"):
            return line.split("=", 1)[1].strip().strip('"')
    raise InstallError("build bundle", f"{repo}/pyproject.toml: no version", "add version = ... to [project]")


def build(repo: Path, out_dir: Path, wheelhouse_from: Path | None = None) -> Path:
    """Build the bundle folder and its tarball under out_dir; returns the folder."""
    version = project_version(repo)
    root = out_dir / f"kunlun-{version}"
    if root.exists():
        shutil.rmtree(root)
    (root / "wheelhouse").mkdir(parents=True)
    step = "build wheelhouse"
    print(f"[{step}] pip wheel {repo} -> {root / 'wheelhouse'}", flush=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-build-isolation",
        "--wheel-dir",
        str(root / "wheelhouse"),
    ]
    # pip's own wheel too: the installer runs pip from it inside each new venv (no ensurepip)
    cmd += [str(repo), f"pip=={importlib.metadata.version('pip')}"]
    if wheelhouse_from is not None:
        cmd[5:5] = ["--no-index", "--find-links", str(wheelhouse_from)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise InstallError(
            step, r.stderr.strip()[-2000:] or "pip wheel failed", "check network access to PyPI"
        )
    (root / "units").mkdir()
    for unit in sorted((repo / "deploy" / "systemd").glob("*.service")):
        shutil.copy2(unit, root / "units" / unit.name)
    (root / "examples").mkdir()
    for ex in sorted((repo / "deploy" / "examples").iterdir()):
        if ex.is_file():
            shutil.copy2(ex, root / "examples" / ex.name)
    shutil.copy2(repo / "deploy" / "replica.example.yaml", root / "examples" / "replica.example.yaml")
    shutil.copy2(repo / "README.md", root / "README.md")
    entry = root / "kunlun-installer"
    entry.write_text(ENTRY_POINT)
    entry.chmod(0o755)
    write_manifest(root, version)
    tar_path = out_dir / f"kunlun-{version}-bundle.tar.gz"
    with tarfile.open(tar_path, "w:gz") as tar:
        tar.add(root, arcname=root.name)
    n = len(list((root / "wheelhouse").glob("*.whl")))
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    print(f"[bundle] {root} ({n} wheels, {size / 1e6:.1f} MB), {tar_path}", flush=True)
    return root
