"""Version skew: the working tree's gRPC contracts stay wire-compatible with every release snapshot."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from scripts.proto_compat import COMPAT, describe, incompatibilities


def test_every_release_snapshot_is_still_compatible() -> None:
    snaps = sorted(COMPAT.glob("*.json"))
    assert snaps, "proto/compat/ holds the snapshot of at least one release"
    current = describe()
    for snap in snaps:
        assert incompatibilities(json.loads(snap.read_text()), current) == [], snap.name


def test_removed_renamed_renumbered_and_retyped_fields_are_caught() -> None:
    old = json.loads((COMPAT / "0.1.0.json").read_text())
    new = copy.deepcopy(old)
    msg = "kunlun.v1.Heartbeat"
    fields = new["messages"][msg]
    name = sorted(fields)[0]
    moved = fields.pop(name)
    assert incompatibilities(old, new) == [f"{msg}.{name} (field {moved['number']}) removed"]
    fields["renamed"] = moved
    assert incompatibilities(old, new) == [f"{msg}.{name} (field {moved['number']}) renamed to renamed"]
    del fields["renamed"]
    fields[name] = dict(moved, number=moved["number"] + 100)
    assert incompatibilities(old, new)[0].startswith(f"{msg}.{name}: number")
    fields[name] = dict(moved, repeated=not moved["repeated"])
    assert "repeated" in incompatibilities(old, new)[0]
    new = copy.deepcopy(old)
    new["messages"][msg]["added"] = dict(moved, number=999)
    assert incompatibilities(old, new) == [], "adding a field is compatible"
    rpc = sorted(new["methods"])[0]
    del new["methods"][rpc]
    assert incompatibilities(old, new) == [f"rpc {rpc} removed"]


def test_snapshot_files_are_the_descriptor_format() -> None:
    for snap in COMPAT.glob("*.json"):
        data = json.loads(Path(snap).read_text())
        assert set(data) == {"messages", "methods"}
