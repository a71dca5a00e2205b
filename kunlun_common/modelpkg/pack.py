"""`model pack`: a model folder (and an optional compile cache) into a .kunlunpkg tar stream.

Two passes over the files, each in fixed chunks: the first hashes them (the manifest, which comes
first in the archive, needs every hash), the second copies them into the archive. A file whose size
or modification time changed between the passes is refused rather than packed with a stale hash. The
output is written to `NAME.partial` and renamed when complete, so a half-written package never exists
under its final name.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kunlun_common.messages import Message, msg, msg_list
from kunlun_common.modelpkg import profiles, weights
from kunlun_common.modelpkg.errors import PackInputError
from kunlun_common.modelpkg.manifest import (
    CACHE_DIR,
    MANIFEST_NAME,
    MAX_FILES,
    MODEL_DIR,
    NAME_RE,
    SIGNATURE_NAME,
    FileEntry,
    Manifest,
    digest_of,
)
from kunlun_common.modelpkg.signing import key_id, sign_manifest
from kunlun_common.modelpkg.tarstream import CHUNK, TarWriter

Progress = Callable[[str, int, int], None]  # (phase, bytes done, bytes total)


@dataclass(frozen=True)
class PackOptions:
    """What to pack and how."""

    model_dir: Path
    """The model folder (config.json, tokenizer files, weights)."""
    output: Path
    """The .kunlunpkg to write (must not exist)."""
    name: str | None = None
    """Package name; default: the folder name, lowercased."""
    version: str = "1"
    """Free-form package version."""
    quantization: str | None = None
    """Precision the engine runs the weights at (w8a8, int8, fp8, int4, awq, gptq, fp16, bf16); recorded, not converted."""
    target_devices: tuple[str, ...] = ()
    """`TYPE[:INDEX]` of each device the package is built for."""
    device_config: Path | None = None
    """A device-plugin-config.yaml declaring the target devices (profile snapshot and checks)."""
    engine: str = "sglang"
    """The engine that loads the weights."""
    engine_version: str = ""
    """The engine's version the package was prepared with."""
    compile_cache: Path | None = None
    """A folder of compiled graphs/kernels to seed into the node's cache (stored under cache/)."""


@dataclass(frozen=True)
class PackResult:
    manifest: Manifest
    digest: str
    key_id: str | None
    path: Path


def _walk(root: Path, prefix: str) -> list[tuple[str, Path]]:
    out: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for fn in sorted(filenames):
            src = Path(dirpath) / fn
            if src.is_symlink() or not src.is_file():
                raise PackInputError(
                    msg(
                        "package.pack.not_regular_file_links",
                        "{src}: not a regular file (links and devices cannot be packed)",
                        src=src,
                    )
                )
            rel = src.relative_to(root).as_posix()
            out.append((f"{prefix}/{rel}", src))
    if len(out) > MAX_FILES:
        raise PackInputError(
            msg(
                "package.pack.more_than_files",
                "{root}: more than {max_files} files",
                root=root,
                max_files=MAX_FILES,
            )
        )
    return out


def _hash(src: Path, buf: bytearray) -> str:
    h = hashlib.sha256()
    mv = memoryview(buf)
    with src.open("rb", buffering=0) as f:
        while n := f.readinto(mv):
            h.update(mv[:n])
    return h.hexdigest()


def plan_manifest(
    opts: PackOptions, progress: Progress | None = None
) -> tuple[Manifest, list[tuple[str, Path, os.stat_result]]]:
    """The manifest (every file hashed) and the files to copy, with the stat each must still have."""
    if not opts.model_dir.is_dir():
        raise PackInputError(
            msg(
                "package.pack.not_folder_give_model",
                "{model_dir}: not a folder; give the model folder (config.json and weights)",
                model_dir=opts.model_dir,
            )
        )
    name = opts.name or opts.model_dir.resolve().name.lower()
    if not NAME_RE.match(name):
        raise PackInputError(
            msg(
                "package.pack.package_name_use_lowercase",
                "package name {name!r}: use lowercase letters, digits, '.', '_', '-'; pass --name",
                name=name,
            )
        )
    if opts.quantization is not None and opts.quantization not in weights.QUANT_BITS:
        raise PackInputError(
            msg(
                "package.pack.quantize_expected_one",
                "--quantize {quantization!r}: expected one of {items}",
                quantization=opts.quantization,
                items=", ".join(weights.QUANT_BITS),
            )
        )
    files = _walk(opts.model_dir, MODEL_DIR)
    if opts.compile_cache is not None:
        if not opts.compile_cache.is_dir():
            raise PackInputError(
                msg(
                    "package.pack.compile_cache_not_folder",
                    "--compile-cache {compile_cache}: not a folder",
                    compile_cache=opts.compile_cache,
                )
            )
        files += _walk(opts.compile_cache, CACHE_DIR)
    rels = [a[len(MODEL_DIR) + 1 :] for a, _ in files if a.startswith(MODEL_DIR + "/")]
    info = weights.detect(opts.model_dir, rels)
    problem = weights.engine_problem(opts.engine, info.weight_format)
    if problem:
        raise PackInputError(problem)
    targets = [profiles.parse_target(t) for t in opts.target_devices]
    device_profiles = (
        [profiles.snapshot(opts.device_config, t, i) for t, i in targets] if opts.device_config else []
    )
    min_mb = weights.min_device_memory_mb(info, opts.quantization)
    _check_profiles(device_profiles, opts.quantization, info, min_mb)
    stats = [(a, s, s.stat()) for a, s in files]
    total = sum(st.st_size for _, _, st in stats)
    buf = bytearray(CHUNK)
    entries: list[FileEntry] = []
    done = 0
    for arc, src, st in stats:
        entries.append(FileEntry(arc, st.st_size, _hash(src, buf)))
        done += st.st_size
        if progress:
            progress("hashing", done, total)
    manifest = Manifest(
        name=name,
        version=opts.version,
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        weight_format=info.weight_format,
        architecture=info.architecture,
        parameter_count=info.parameter_count,
        parameter_count_source=info.parameter_count_source,
        quantization=opts.quantization,
        dtypes=list(info.dtypes),
        target_device_types=sorted({t for t, _ in targets}),
        weights_bytes=weights.weights_bytes(info, opts.quantization),
        min_device_memory_mb=min_mb,
        engine=opts.engine,
        engine_version=opts.engine_version,
        device_profiles=device_profiles,
        compile_cache=CACHE_DIR + "/" if opts.compile_cache is not None else None,
        files=entries,
    )
    return manifest, stats


def _check_profiles(
    profs: list[dict[str, Any]], quant: str | None, info: weights.WeightInfo, min_mb: int
) -> None:
    """The pitfalls, caught at pack time: a precision the device refuses, a model too big for it."""
    problems: list[Message] = []
    for p in profs:
        where = f"{p['device_type']}:{p['device_id']}" if p["device_id"] is not None else p["device_type"]
        dtypes = p.get("supported_dtypes")
        wanted = [quant] if quant else [d for d in info.dtypes if d in weights.QUANT_BITS]
        if isinstance(dtypes, list):
            refused = [d for d in wanted if d not in dtypes]
            if refused:
                problems.append(
                    msg(
                        "package.pack.does_not_support_supported",
                        "{where} does not support {items} (supported_dtypes: {items2}); choose another --quantize or target",
                        where=where,
                        items=", ".join(refused),
                        items2=", ".join(map(str, dtypes)),
                    )
                )
        hbm = p.get("hbm_memory_mb")
        if isinstance(hbm, int) and min_mb > hbm:
            problems.append(
                msg(
                    "package.pack.has_mib_device_memory",
                    "{where} has {hbm} MiB of device memory; the package needs at least {min_mb} MiB; quantize further or choose a larger device",
                    where=where,
                    hbm=hbm,
                    min_mb=min_mb,
                )
            )
    if problems:
        raise PackInputError(
            msg_list(
                "package.pack.cannot_pack_for_target", "cannot pack for the target device:\n{parts}", problems
            )
        )


def pack(opts: PackOptions, key: Ed25519PrivateKey | None, progress: Progress | None = None) -> PackResult:
    if opts.output.exists():
        raise PackInputError(
            msg(
                "package.pack.exists_remove_choose_another",
                "{output} exists; remove it or choose another --output",
                output=opts.output,
            )
        )
    manifest, stats = plan_manifest(opts, progress)
    mbytes = manifest.canonical()
    partial = opts.output.with_name(opts.output.name + ".partial")
    total = manifest.total_bytes
    done = 0
    try:
        with partial.open("wb") as out:
            w = TarWriter(out)
            w.add_bytes(MANIFEST_NAME, mbytes)
            if key is not None:
                w.add_bytes(SIGNATURE_NAME, sign_manifest(mbytes, key))
            for (arc, src, st), entry in zip(stats, manifest.files, strict=True):
                h = hashlib.sha256() if entry.size <= CHUNK else None
                with src.open("rb", buffering=0) as f:
                    now = os.fstat(f.fileno())
                    if (now.st_size, now.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
                        raise PackInputError(
                            msg(
                                "package.pack.changed_while_packing_pack_2",
                                "{src} changed while packing; pack again when it is stable",
                                src=src,
                            )
                        )
                    w.add_stream(arc, f, st.st_size, int(st.st_mtime), h.update if h else _noop)
                if h is not None and h.hexdigest() != entry.sha256:
                    raise PackInputError(
                        msg(
                            "package.pack.changed_while_packing_pack",
                            "{src} changed while packing; pack again when it is stable",
                            src=src,
                        )
                    )
                done += entry.size
                if progress:
                    progress("writing", done, total)
            w.close()
            os.fsync(out.fileno())
        partial.rename(opts.output)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return PackResult(manifest, digest_of(mbytes), key_id(key.public_key()) if key else None, opts.output)


def _noop(_: memoryview) -> None:
    return None
