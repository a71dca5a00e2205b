"""Generate the Python gRPC code for proto/kunlun/v1/*.proto into kunlun_common/api/.

The one way generated code is made; tests/test_proto_fresh.py fails when the committed output
is stale. Usage: python scripts/gen_proto.py [OUT_DIR]  (default: kunlun_common/api)
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PACKAGE = "kunlun_common.api"
_IMPORT_RE = re.compile(r"^from kunlun\.v1 import ", re.MULTILINE)
_IMPORT_PYI_RE = re.compile(r"^import kunlun\.v1\.(\w+)", re.MULTILINE)


def generate(out_dir: Path) -> list[Path]:
    """Run protoc and flatten the output into out_dir; return the written files."""
    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    bin_dir = Path(sys.executable).parent
    well_known = Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_DIR}",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"--plugin=protoc-gen-mypy={bin_dir / 'protoc-gen-mypy'}",
            f"--plugin=protoc-gen-mypy_grpc={bin_dir / 'protoc-gen-mypy_grpc'}",
            f"--mypy_out={tmp}",
            f"--mypy_grpc_out={tmp}",
            *protos,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for src in sorted((Path(tmp) / "kunlun" / "v1").iterdir()):
            text = src.read_text()
            text = _IMPORT_RE.sub(f"from {PACKAGE} import ", text)
            text = _IMPORT_PYI_RE.sub(lambda m: f"import {PACKAGE}.{m.group(1)}", text)
            text = text.replace("kunlun.v1.types_pb2.", f"{PACKAGE}.types_pb2.")
            dst = out_dir / src.name
            dst.write_text(text)
            written.append(dst)
        init = out_dir / "__init__.py"
        init.write_text('"""Generated gRPC code for proto/kunlun/v1 (scripts/gen_proto.py)."""\n')
        written.append(init)
        typed = out_dir / "py.typed"
        if not typed.exists():
            typed.write_text("")
        return written


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "kunlun_common" / "api"
    if out.exists() and out == ROOT / "kunlun_common" / "api":
        for old in out.glob("*_pb2*"):
            old.unlink()
    for path in generate(out):
        print(f"wrote {path}")
    shutil.rmtree(out / "__pycache__", ignore_errors=True)


if __name__ == "__main__":
    main()
