"""Architecture rules: controlplane, node_agent and gateway never import each other; nothing but the store imports etcd."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


# The three processes live side by side and never import each other; the development launcher
# (devcluster) starts all three and may import them all.
PROCESSES = ("controlplane", "node_agent", "gateway")


def test_processes_do_not_import_each_other() -> None:
    offenders = {}
    for top in PROCESSES:
        others = {p for p in PROCESSES if p != top} | {"devcluster"}
        for p in (ROOT / top).rglob("*.py"):
            bad = sorted(m for m in imports_of(p) if m.split(".")[0] in others)
            if bad:
                offenders[str(p.relative_to(ROOT))] = bad
    assert offenders == {}


def test_only_the_store_imports_the_etcd_client() -> None:
    offenders = []
    for top in ("controlplane", "node_agent", "gateway", "devcluster", "kunlun_common", "chaos", "bench"):
        for p in (ROOT / top).rglob("*.py"):
            if "controlplane/store" in str(p):
                continue
            if any(m.split(".")[0] in ("aetcd", "etcd3") for m in imports_of(p)):
                offenders.append(str(p.relative_to(ROOT)))
    assert offenders == []


def test_kunlun_common_stands_alone() -> None:
    for p in (ROOT / "kunlun_common").rglob("*.py"):
        assert not {m for m in imports_of(p) if m.split(".")[0] in (*PROCESSES, "devcluster")}, p


def test_no_top_level_package_named_proto() -> None:
    assert not (ROOT / "proto" / "__init__.py").exists()
