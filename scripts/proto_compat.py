"""Wire compatibility of the gRPC contracts across releases (version skew during rolling upgrades).

Replicas, agents and gateways of release N and N+1 run side by side during an upgrade, so a field
may be added but never removed, renumbered, retyped or moved between singular and repeated, and an
RPC never removed or changed in its message types. `snapshot` records every message's fields and
every service's methods from the generated descriptors; `check` compares the working tree with the
last release's snapshot (proto/compat/<version>.json, committed at release time).

    python scripts/proto_compat.py snapshot 0.1.0     # at release time
    python scripts/proto_compat.py check              # in the tests, against every committed snapshot
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
from pathlib import Path
from typing import Any

from google.protobuf.descriptor import Descriptor, FileDescriptor

ROOT = Path(__file__).resolve().parent.parent
COMPAT = ROOT / "proto" / "compat"


def _messages(prefix: str, d: Descriptor, out: dict[str, Any]) -> None:
    name = f"{prefix}{d.name}"
    out[name] = {
        f.name: {"number": f.number, "type": f.type, "repeated": f.is_repeated, "message": (
            f.message_type.full_name if f.message_type is not None else ""
        )}
        for f in d.fields
    }  # fmt: skip
    for nested in d.nested_types:
        _messages(name + ".", nested, out)


def describe() -> dict[str, Any]:
    """{"messages": {full name: {field: {...}}}, "methods": {service.method: [in, out, streams]}}."""
    import kunlun_common.api as api

    messages: dict[str, Any] = {}
    methods: dict[str, Any] = {}
    for mod in pkgutil.iter_modules(api.__path__):
        if not mod.name.endswith("_pb2"):
            continue
        fd: FileDescriptor = importlib.import_module(f"kunlun_common.api.{mod.name}").DESCRIPTOR
        for d in fd.message_types_by_name.values():
            _messages(f"{fd.package}.", d, messages)
        for svc in fd.services_by_name.values():
            for m in svc.methods:
                methods[f"{svc.full_name}.{m.name}"] = [
                    m.input_type.full_name,
                    m.output_type.full_name,
                    bool(m.client_streaming),
                    bool(m.server_streaming),
                ]
    return {"messages": messages, "methods": methods}


def incompatibilities(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What breaks a peer built from `old` talking to one built from `new` (empty: compatible)."""
    out = []
    for msg, fields in sorted(old["messages"].items()):
        now = new["messages"].get(msg)
        if now is None:
            out.append(f"message {msg} removed")
            continue
        by_number = {f["number"]: name for name, f in now.items()}
        for name, f in sorted(fields.items()):
            g = now.get(name)
            if g is None:
                taken = by_number.get(f["number"])
                what = f"renamed to {taken}" if taken else "removed"
                out.append(f"{msg}.{name} (field {f['number']}) {what}")
            elif g != f:
                changes = [f"{k} {f[k]} -> {g[k]}" for k in f if g.get(k) != f[k]]
                out.append(f"{msg}.{name}: {', '.join(changes)}")
    for method, sig in sorted(old["methods"].items()):
        cur = new["methods"].get(method)
        if cur is None:
            out.append(f"rpc {method} removed")
        elif cur != sig:
            out.append(f"rpc {method}: {sig} -> {cur}")
    return out


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "snapshot":
        COMPAT.mkdir(parents=True, exist_ok=True)
        path = COMPAT / f"{argv[1]}.json"
        path.write_text(json.dumps(describe(), indent=1, sort_keys=True) + "\n")
        print(f"wrote {path}")
        return 0
    if argv == ["check"]:
        current = describe()
        bad = 0
        for snap in sorted(COMPAT.glob("*.json")):
            problems = incompatibilities(json.loads(snap.read_text()), current)
            for p in problems:
                print(f"{snap.name}: {p}")
            bad += len(problems)
        print("compatible with every release snapshot" if not bad else f"{bad} incompatible change(s)")
        return 1 if bad else 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
