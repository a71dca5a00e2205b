"""A wheel built from the sources alone (no `make install`, so no compiled catalog in the tree)
carries the compiled zh_CN catalog: setup.py's build step compiles every .po into the build output.
`make dist` builds its wheel the same way (`pip wheel --no-build-isolation`, kunlun_installer/bundle.py)."""

from __future__ import annotations

import gettext
import io
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from kunlun_common import po

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (
    "controlplane",
    "node_agent",
    "kunlun_common",
    "gateway",
    "devcluster",
    "kunlun_installer",
    "chaos",
)
CATALOG = "kunlun_common/locale/zh_CN/LC_MESSAGES/kunlun"


def test_a_wheel_built_without_make_install_carries_the_compiled_catalog(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for f in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / f, src / f)
    for pkg in PACKAGES:  # the sources as a fresh checkout has them: no .mo, no caches
        shutil.copytree(
            ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("*.mo", "*.mo.tmp", "__pycache__")
        )
    assert not list(src.rglob("*.mo"))
    out = tmp_path / "wheel"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-build-isolation",
            "--no-deps",
            "--wheel-dir",
            str(out),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = out.glob("kunlun_platform-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert f"{CATALOG}.po" in names
        assert f"{CATALOG}.mo" in names, sorted(n for n in names if "locale" in n)
        mo = z.read(f"{CATALOG}.mo")
    assert mo == po.compile_mo(po.load(ROOT / f"{CATALOG}.po"))
    t = gettext.GNUTranslations(io.BytesIO(mo))
    assert t.gettext("options") == "选项"
    assert t.pgettext("spec.invalid", "invalid workload spec:\n{parts}") == "无效的工作负载规格：\n{parts}"
