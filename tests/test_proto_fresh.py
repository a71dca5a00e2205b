"""The committed generated code equals what scripts/gen_proto.py makes from proto/ now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    out = tmp_path / "api"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), str(out)], check=True, capture_output=True
    )
    committed = ROOT / "kunlun_common" / "api"
    fresh = {p.name: p.read_text() for p in out.iterdir() if p.suffix in (".py", ".pyi")}
    have = {p.name: p.read_text() for p in committed.iterdir() if p.suffix in (".py", ".pyi")}
    assert set(fresh) == set(have), "generated file set differs: run `make proto` and commit"
    stale = [name for name in fresh if fresh[name] != have[name]]
    assert not stale, f"stale generated code {stale}: run `make proto` and commit"
