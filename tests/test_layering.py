"""Architecture rules: node_agent never imports controlplane; nothing but the store imports etcd."""

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


def test_node_agent_does_not_import_controlplane() -> None:
    offenders = {
        str(p.relative_to(ROOT)): sorted(m for m in imports_of(p) if m.split(".")[0] == "controlplane")
        for p in (ROOT / "node_agent").rglob("*.py")
    }
    assert not {k: v for k, v in offenders.items() if v}


def test_only_the_store_imports_the_etcd_client() -> None:
    offenders = []
    for top in ("controlplane", "node_agent", "kunlun_common", "chaos", "bench"):
        for p in (ROOT / top).rglob("*.py"):
            if "controlplane/store" in str(p):
                continue
            if any(m.split(".")[0] in ("aetcd", "etcd3") for m in imports_of(p)):
                offenders.append(str(p.relative_to(ROOT)))
    assert offenders == []


def test_kunlun_common_stands_alone() -> None:
    for p in (ROOT / "kunlun_common").rglob("*.py"):
        assert not {m for m in imports_of(p) if m.split(".")[0] in ("controlplane", "node_agent")}, p


def test_no_top_level_package_named_proto() -> None:
    assert not (ROOT / "proto" / "__init__.py").exists()
