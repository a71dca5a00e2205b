"""Offline model packages on a node: find, verify, unpack, and seed the compile cache before a launch.

A workload spec naming `package: NAME@sha256:DIGEST` is launched from the package's unpacked folder.
The node-local store is `<state_dir>/packages/` (package_cache.py): operators put `.kunlunpkg` files
in `incoming/`, pulls from the cluster store land in `pulled/`; the first launch that needs a digest verifies the file and unpacks it in the same pass
into `unpacked/<hex>/`, then writes `.verified` (cached by digest: later launches reuse it). The
digest is recomputed from the bytes read, so a file swapped after it was found is still caught.

When signatures are required (the agent's `--require-signed-packages` or the cluster policy) the
signature must verify with a trusted key (`--trusted-keys` and the cluster's); otherwise the hashes
are checked and the signature is not. A pulled file is deleted once unpacked, and when it fails. Any problem fails the instance permanently
(`PrepareError`), with the reason in `workload describe`; no engine is started.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from kunlun_common.messages import Message, msg, of_error
from kunlun_common.modelpkg import PackageError, TrustedKeys, read_head, verify_file
from kunlun_common.modelpkg.manifest import CACHE_DIR, MODEL_DIR

MARKER = ".verified"
REF_RE = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?@sha256:[0-9a-f]{64}$")
"""NAME@sha256:HEX, as the control plane validates it at submit (checked again: it names files here)."""


class PackageRefused(Exception):
    """The package cannot be used on this node; the message says why and what to do."""

    def __init__(self, message: str | Message) -> None:
        super().__init__(str(message))
        self.localizable: Message | None = message if isinstance(message, Message) else None


@dataclass(frozen=True)
class Unpacked:
    model_dir: Path
    cache_dir: Path | None
    key_id: str | None


def find(root: Path, name: str, digest: str) -> Path:
    """The package file `name@digest` on this node: pulled, or copied into `incoming/`."""
    pulled = root / "pulled" / f"{digest.removeprefix('sha256:')}.kunlunpkg"
    incoming = root / "incoming"
    candidates = [pulled] if pulled.is_file() else []
    candidates += sorted(incoming.glob("*.kunlunpkg")) if incoming.is_dir() else []
    for f in candidates:
        try:
            head = read_head(f)
        except PackageError:
            continue
        if head.digest == digest and head.manifest.name == name:
            return f
    raise PackageRefused(not_here(incoming))


def not_here(incoming: Path) -> Message:
    return msg(
        "package.not_on_node",
        "not on this node: put the .kunlunpkg into {incoming} (kunlun-cli model inspect shows its digest)",
        incoming=incoming,
    )


def check_ref(ref: str) -> None:
    """PackageRefused unless `ref` is NAME@sha256:HEX."""
    if not REF_RE.match(ref):
        raise PackageRefused(
            msg("package.bad_ref", "package: {ref!r} is not NAME@sha256:DIGEST", ref=ref[:80])
        )


def unpack_verified(root: Path, ref: str, trusted: TrustedKeys, require_signed: bool) -> Unpacked:
    """The unpacked, verified package `NAME@sha256:HEX` (blocking: run in a thread)."""
    check_ref(ref)
    name, _, digest = ref.partition("@")
    dest = root / "unpacked" / digest.removeprefix("sha256:")
    marker = dest / MARKER
    if marker.is_file() and require_signed and not signature_checked(dest):
        shutil.rmtree(dest, ignore_errors=True)  # unpacked when signatures were not required: check again
    if marker.is_file():
        kid = json.loads(marker.read_text()).get("key_id")
        if require_signed and kid is None:
            raise PackageRefused(
                msg("package.unsigned", "package is unsigned; signed packages are required on this cluster")
            )
        if require_signed and kid not in trusted.keys:
            raise PackageRefused(
                msg(
                    "package.untrusted_key",
                    "package signed by key {kid}, which is not trusted now; trust it (`kunlun-cli model trust add`)",
                    kid=kid,
                )
            )
    else:
        src = find(root, name, digest)
        pulled = src.parent.name == "pulled"
        tmp = dest.with_name(f"{dest.name}.partial-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            v = verify_file(
                src,
                trusted,
                require_signature=require_signed,
                extract_to=tmp,
                ignore_signature=not require_signed,
            )
        except PackageError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if pulled:
                src.unlink(missing_ok=True)
            what = msg("package.pulled", "pulled package") if pulled else src.name
            raise PackageRefused(
                msg("package.unusable", "{what}: {error}", what=what, error=of_error(e))
            ) from None
        if v.head.digest != digest:
            shutil.rmtree(tmp, ignore_errors=True)
            raise PackageRefused(
                msg(
                    "package.changed",
                    "{name} changed while being verified (digest {digest})",
                    name=src.name,
                    digest=v.head.digest,
                )
            )
        kid = v.key_id
        marker_data = {
            "key_id": kid,
            "source": src.name,
            "bytes": _tree_bytes(tmp),
            "signature_checked": require_signed,
        }
        (tmp / MARKER).write_text(json.dumps(marker_data))
        if dest.exists():  # another start unpacked it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.rename(dest)
        if pulled:
            src.unlink(missing_ok=True)
    cache = dest / CACHE_DIR
    return Unpacked(dest / MODEL_DIR, cache if cache.is_dir() else None, kid)


def signature_checked(d: Path) -> bool:
    """Whether the unpacked package's signature was checked (and found trusted, or absent)."""
    try:
        return bool(json.loads((d / MARKER).read_text()).get("signature_checked", False))
    except (OSError, ValueError, AttributeError):
        return False


def _tree_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file() and not f.is_symlink())


def unpacked_bytes(d: Path) -> int:
    """Bytes of an unpacked package (recorded in its marker; counted when an older marker lacks it)."""
    try:
        return int(json.loads((d / MARKER).read_text())["bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return _tree_bytes(d)


def seed_cache(pkg: Unpacked, cache_dir: Path) -> int:
    """Copy the package's compile cache into the node's cache (existing files kept); files copied."""
    if pkg.cache_dir is None:
        return 0
    n = 0
    for src in pkg.cache_dir.rglob("*"):
        if src.is_file():
            dst = cache_dir / src.relative_to(pkg.cache_dir)
            if not dst.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
                n += 1
    return n


async def resolve(instances_dir: Path, ref: str, trusted_keys_dir: str, require_signed: bool) -> Unpacked:
    """The package for a launch; PackageRefused with the reason."""
    trusted = TrustedKeys.load([], [Path(trusted_keys_dir)] if trusted_keys_dir else [])
    return await asyncio.to_thread(
        unpack_verified, instances_dir.parent / "packages", ref, trusted, require_signed
    )
