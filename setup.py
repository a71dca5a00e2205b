"""The build's one addition to setuptools (pyproject.toml holds everything else): the message catalogs.

Every kunlun_common/locale/<lang>/LC_MESSAGES/kunlun.po is compiled to the kunlun.mo that gettext
reads, into the build output next to it, so that any wheel (`make dist`, `pip wheel .`) carries the
catalogs whether or not `make install` compiled them in the source tree (the .mo files are not
committed). The compiler is kunlun_common/po.py, loaded from its file: the build environment has
only setuptools, not this package's dependencies. tests/test_i18n_build.py builds a wheel from a
clean copy of the sources and checks that its catalog is the compiled .po.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
LOCALE = Path("kunlun_common") / "locale"


def _po() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_kunlun_build_po", HERE / "kunlun_common" / "po.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


class BuildPyWithCatalogs(build_py):
    """build_py, then every .po compiled to its .mo in the build folder."""

    def catalogs(self) -> list[tuple[Path, Path]]:
        """(source .po, .mo to write) pairs."""
        return [
            (src, Path(self.build_lib) / src.relative_to(HERE).with_suffix(".mo"))
            for src in sorted((HERE / LOCALE).glob("*/LC_MESSAGES/*.po"))
        ]

    def run(self) -> None:
        super().run()
        po = _po()
        for src, mo in self.catalogs():
            mo.parent.mkdir(parents=True, exist_ok=True)
            mo.write_bytes(po.compile_mo(po.load(src)))
            print(f"compiled {src.relative_to(HERE)} -> {mo}")

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outs = list(super().get_outputs(include_bytecode))
        return outs + [str(mo) for _, mo in self.catalogs() if str(mo) not in outs]


setup(cmdclass={"build_py": BuildPyWithCatalogs})
