"""Workloads on model packages: the agent's executor verifies the package before the first launch,
launches from the unpacked folder with the compile cache seeded, and never starts an engine on a
tampered, unsigned (when signatures are required) or missing package."""

from __future__ import annotations

import shutil
import tarfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from controlplane.workloads.spec import SpecError, checked
from kunlun_common.api import workload_pb2
from kunlun_common.modelpkg import PackOptions, load_private_key, pack
from tests.modelpkg_helpers import make_keys, make_model
from tests.test_executor_manager import Harness, assignment, assignments, needs_root, phase, status, until


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[Harness, Path, Path, str, str]]:
    """(harness requiring signatures, incoming folder, signed package, its ref, an unsigned ref)."""
    priv, pub, _ = make_keys(tmp_path / "keys", "release")
    trust = tmp_path / "trusted"
    trust.mkdir()
    shutil.copy(pub, trust / "release.pub")
    model = make_model(tmp_path / "tiny")
    cc = tmp_path / "cc"
    (cc / "graphs").mkdir(parents=True)
    (cc / "graphs" / "g0.om").write_bytes(b"compiled graph")
    incoming = tmp_path / "packages" / "incoming"
    incoming.mkdir(parents=True)
    signed = pack(PackOptions(model, incoming / "tiny.kunlunpkg", compile_cache=cc), load_private_key(priv))
    unsigned = pack(PackOptions(model, tmp_path / "u.kunlunpkg", name="tiny-unsigned"), None)
    shutil.copy(unsigned.path, incoming / "u.kunlunpkg")
    h = Harness(tmp_path, [0.0], require_signed_packages=True, trusted_keys_dir=str(trust))
    h.ctx = replace(h.ctx, cache_root=tmp_path / "cache")
    yield h, incoming, signed.path, f"tiny@{signed.digest}", f"tiny-unsigned@{unsigned.digest}"
    h.cleanup()


@needs_root
async def test_verified_package_launches_from_its_unpacked_folder(
    setup: tuple[Harness, Path, Path, str, str],
) -> None:
    h, incoming, _, ref, _ = setup
    m = h.manager()
    await m.start()
    try:
        m.assign(assignments(assignment("p1", package=ref)))
        await until(lambda: phase(m, "p1") == "Running", 60, "p1 Running")
        st = status(m, "p1")
        assert st is not None
        unpacked = incoming.parent / "unpacked" / ref.split(":", 1)[1]
        assert str(unpacked / "model") in st.command
        assert (unpacked / ".verified").is_file() and (unpacked / "model" / "config.json").is_file()
        assert list((h.ctx.cache_root or Path("/")).rglob("g0.om")), "compile cache not seeded"
    finally:
        await m.close()


async def test_tampered_unsigned_or_missing_package_never_starts_an_engine(
    setup: tuple[Harness, Path, Path, str, str],
) -> None:
    h, incoming, pkg, ref, unsigned_ref = setup
    with tarfile.open(pkg) as t:
        off = t.getmember("model/model.safetensors").offset_data + 4096
    data = bytearray(pkg.read_bytes())
    data[off] ^= 0x10
    pkg.write_bytes(bytes(data))  # same manifest (same digest), one bit of the weights flipped
    missing = "other@sha256:" + "ab" * 32
    m = h.manager()
    await m.start()
    try:
        m.assign(
            assignments(
                assignment("t1", package=ref),
                assignment("t2", dev=1, package=unsigned_ref),
            )
        )
        await until(lambda: phase(m, "t1") == "Failed" and phase(m, "t2") == "Failed", 30, "both Failed")
        t1, t2 = status(m, "t1"), status(m, "t2")
        assert t1 is not None and t2 is not None
        assert "model/model.safetensors: SHA-256" in t1.reason and "changed after packing" in t1.reason
        assert "package is unsigned" in t2.reason
        for st in (t1, t2):
            assert st.pid == 0 and not st.command and st.started_at_unix_ms == 0  # no engine, ever
        assert not list((incoming.parent / "unpacked").glob("*")), "nothing unpacked is left behind"
        m.assign(assignments(assignment("t3", package=missing), revision=2))
        await until(lambda: phase(m, "t3") == "Failed", 30, "t3 Failed")
        t3 = status(m, "t3")
        assert t3 is not None and "not on this node" in t3.reason and str(incoming) in t3.reason
    finally:
        await m.close()


def test_spec_package_field_is_validated() -> None:
    ok = checked(workload_pb2.WorkloadSpec(package="qwen3-8b@sha256:" + "0" * 64))
    assert ok.model == "qwen3-8b" and ok.name == "qwen3-8b"
    with pytest.raises(SpecError, match="package: 'qwen' is not NAME@sha256:DIGEST"):
        checked(workload_pb2.WorkloadSpec(model="m", package="qwen"))
