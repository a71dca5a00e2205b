"""`kunlun-cli model keygen|pack|verify|inspect`: offline model packages (.kunlunpkg).

These commands need no cluster. `verify` exit codes: 0 verified; 1 the command could not run (missing
file, bad flag, unreadable key); 2 not a package (truncated, not tar, manifest missing or invalid);
3 signature problem (unsigned, changed manifest, untrusted key); 4 content problem (a file's size or
SHA-256 differs, a file added or removed); the message names the first bad file.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from controlplane.cli.config import default_path
from controlplane.cli.output import print_json
from kunlun_common.i18n import _, error_text
from kunlun_common.modelpkg import (
    EXIT_OK,
    Head,
    PackageError,
    PackOptions,
    TrustedKeys,
    generate_keypair,
    load_private_key,
    pack,
    read_head,
    verify_file,
)
from kunlun_common.modelpkg.weights import ENGINE_WEIGHT_FORMATS, QUANT_BITS


def default_key_dir() -> Path:
    return default_path().parent / "keys"


def default_trust_dir() -> Path:
    """Public keys `model verify` trusts without --trusted-key."""
    return default_path().parent / "trusted-keys"


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    m = sub.add_parser("model", help="offline model packages (.kunlunpkg)", parents=[common])
    msub = m.add_subparsers(dest="cmd", required=True)
    k = msub.add_parser(
        "keygen", help="make an Ed25519 signing key pair (NAME.key, NAME.pub)", parents=[common]
    )
    k.add_argument("--name", default="signing", help="file name stem (default signing)")
    k.add_argument("--dir", help="where to write the keys (default: keys/ beside the client config)")
    k.set_defaults(handler=model_keygen)
    p = msub.add_parser("pack", help="pack a model folder into a signed .kunlunpkg", parents=[common])
    p.add_argument("--model", required=True, help="the model folder (config.json, tokenizer, weights)")
    p.add_argument("--out", help="package file to write (default NAME.kunlunpkg)")
    p.add_argument("--name", help="package name (default: the folder name, lowercased)")
    p.add_argument("--version", default="1", help="package version (default 1)")
    p.add_argument("--quantize", choices=sorted(QUANT_BITS), help="precision the engine runs the weights at")
    p.add_argument(
        "--target-device", action="append", default=[], help="TYPE[:INDEX] the package is for, e.g. ascend:0"
    )
    p.add_argument("--device-config", help="device-plugin-config.yaml declaring the target (profile, checks)")
    p.add_argument("--engine", default="sglang", choices=sorted(ENGINE_WEIGHT_FORMATS))
    p.add_argument("--engine-version", default="", help="engine version the package was prepared with")
    p.add_argument("--compile-cache", help="folder of compiled graphs to ship (seeded into the node cache)")
    p.add_argument("--sign-key", help="Ed25519 private key from `model keygen` (unsigned without it)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(handler=model_pack)
    v = msub.add_parser("verify", help="check a package's signature and every file hash", parents=[common])
    v.add_argument("--package", required=True, help="the .kunlunpkg file")
    v.add_argument(
        "--trusted-key", action="append", default=[], help="a trusted public key (.pub), repeatable"
    )
    v.add_argument(
        "--trust-dir", help="folder of trusted *.pub (default: trusted-keys/ beside the client config)"
    )
    v.add_argument("--allow-unsigned", action="store_true", help="accept a package without manifest.sig")
    v.add_argument("--quiet", action="store_true", help="no progress on stderr")
    v.set_defaults(handler=model_verify)
    i = msub.add_parser("inspect", help="what a package holds (reads only its manifest)", parents=[common])
    i.add_argument("package", help="the .kunlunpkg file")
    i.set_defaults(handler=model_inspect)
    from controlplane.cli import store_cmd, trust_cmd

    trust_cmd.register(msub, common)
    store_cmd.register(msub, common)


class _Progress:
    """Progress on stderr: one rewritten line on a terminal, a line every few seconds otherwise."""

    def __init__(self, quiet: bool) -> None:
        self.quiet, self.tty = quiet, sys.stderr.isatty()
        self.last, self.phase = 0.0, ""

    def __call__(self, phase: str, done: int, total: int) -> None:
        now = time.monotonic()
        end = done >= total
        if self.quiet or (phase == self.phase and not end and now - self.last < (0.2 if self.tty else 2.0)):
            return
        self.last, self.phase = now, phase
        pct = 100 * done // total if total else 100
        line = f"{phase:<9} {pct:3d}%  {done / 1e9:.2f} / {total / 1e9:.2f} GB"
        sys.stderr.write(("\r" + line + ("\n" if end else "")) if self.tty else line + "\n")
        sys.stderr.flush()


def model_keygen(args: argparse.Namespace) -> int:
    d = Path(args.dir) if args.dir else default_key_dir()
    d.mkdir(parents=True, exist_ok=True)
    priv, pub = d / f"{args.name}.key", d / f"{args.name}.pub"
    kid = generate_keypair(priv, pub)
    if args.output == "json":
        print_json({"key_id": kid, "private_key": str(priv), "public_key": str(pub)})
    else:
        print(
            _("key id       {kid}\nprivate key  {priv}  (keep it secret; sign with --sign-key)").format(
                kid=kid, priv=priv
            )
        )
        print(
            _(
                "public key   {pub}  (give it to verifiers: --trusted-key, or `model trust add` in a cluster)"
            ).format(pub=pub)
        )
    return 0


def model_pack(args: argparse.Namespace) -> int:
    model = Path(args.model)
    key = load_private_key(Path(args.sign_key)) if args.sign_key else None
    name = args.name or model.resolve().name.lower()
    opts = PackOptions(
        model_dir=model,
        output=Path(args.out) if args.out else Path(f"{name}.kunlunpkg"),
        name=args.name,
        version=args.version,
        quantization=args.quantize,
        target_devices=tuple(args.target_device),
        device_config=Path(args.device_config) if args.device_config else None,
        engine=args.engine,
        engine_version=args.engine_version,
        compile_cache=Path(args.compile_cache) if args.compile_cache else None,
    )
    try:
        res = pack(opts, key, _Progress(args.quiet))
    except PackageError as e:
        print(_("kunlun-cli: {e}").format(e=error_text(e)), file=sys.stderr)
        return e.exit_code
    if args.output == "json":
        print_json(
            {"package": str(res.path), "digest": res.digest, "key_id": res.key_id, **_summary(res.manifest)}
        )
    else:
        print(
            _("wrote {path}  {name}@{digest}").format(
                path=res.path, name=res.manifest.name, digest=res.digest
            )
        )
        print(
            _("signed by {key_id}").format(key_id=res.key_id)
            if res.key_id
            else _("UNSIGNED (pass --sign-key to sign)")
        )
    return 0


def model_verify(args: argparse.Namespace) -> int:
    path = Path(args.package)
    if not path.is_file():
        print(_("kunlun-cli: {path}: no such file").format(path=path), file=sys.stderr)
        return 1
    trust_dir = Path(args.trust_dir) if args.trust_dir else default_trust_dir()
    trusted = TrustedKeys.load([Path(k) for k in args.trusted_key], [trust_dir])
    prog = _Progress(args.quiet)
    t0 = time.monotonic()
    try:
        v = verify_file(
            path,
            trusted,
            require_signature=not args.allow_unsigned,
            progress=lambda done, total: prog("verifying", done, total),
        )
    except PackageError as e:
        if args.output == "json":
            print_json(
                {"ok": False, "exit_code": e.exit_code, "error": str(e), "file": getattr(e, "path", None)}
            )
        print(_("kunlun-cli: {path}: {e}").format(path=path, e=error_text(e)), file=sys.stderr)
        return e.exit_code
    secs = time.monotonic() - t0
    m = v.head.manifest
    doc = {
        "ok": True,
        "name": m.name,
        "digest": v.head.digest,
        "signed_by": v.key_id,
        "files": len(m.files),
        "bytes": v.bytes_checked,
        "seconds": round(secs, 3),
    }
    if args.output == "json":
        print_json(doc)
    else:
        who = (
            _("signed by trusted key {key_id}").format(key_id=v.key_id)
            if v.key_id
            else _("UNSIGNED (allowed by --allow-unsigned)")
        )
        rate = v.bytes_checked / secs / 1e6 if secs > 0 else 0.0
        print(
            _("OK {name}@{digest}: {who}; {count} files, {bytes_checked} bytes ({rate:.0f} MB/s)").format(
                name=m.name,
                digest=v.head.digest,
                who=who,
                count=len(m.files),
                bytes_checked=v.bytes_checked,
                rate=rate,
            )
        )
    return EXIT_OK


def _summary(m: Any) -> dict[str, Any]:
    return {
        "name": m.name,
        "version": m.version,
        "weight_format": m.weight_format,
        "architecture": m.architecture,
        "parameter_count": m.parameter_count,
        "quantization": m.quantization,
        "dtypes": m.dtypes,
        "target_device_types": m.target_device_types,
        "min_device_memory_mb": m.min_device_memory_mb,
        "engine": m.engine,
        "engine_version": m.engine_version,
    }


def model_inspect(args: argparse.Namespace) -> int:
    try:
        head: Head = read_head(Path(args.package))
    except PackageError as e:
        print(_("kunlun-cli: {package}: {e}").format(package=args.package, e=error_text(e)), file=sys.stderr)
        return e.exit_code
    m = head.manifest
    doc = {
        "package": args.package,
        "digest": head.digest,
        "signer_key_id": head.signer,
        **_summary(m),
        "created_at": m.created_at,
        "weights_bytes": m.weights_bytes,
        "compile_cache": m.compile_cache,
        "device_profiles": m.device_profiles,
        "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in m.files],
        "total_bytes": m.total_bytes,
    }
    if args.output == "json":
        print_json(doc)
        return 0
    signer = (
        _("{signer} (not checked here: run `model verify`)").format(signer=head.signer)
        if head.signer
        else _("UNSIGNED")
    )
    params = f"{m.parameter_count} ({m.parameter_count_source})" if m.parameter_count else _("unknown")
    rows = [
        (_("Name"), _("{name} (version {version})").format(name=m.name, version=m.version)),
        (_("Digest"), head.digest),
        (_("Signed by"), signer),
        (
            _("Weights"),
            _("{format}, {size} bytes on device").format(format=m.weight_format, size=m.weights_bytes),
        ),
        (_("Architecture"), m.architecture or "-"),
        (_("Parameters"), params),
        (_("Quantization"), m.quantization or "none"),
        (_("Dtypes"), ", ".join(m.dtypes) or "-"),
        (_("Device types"), ", ".join(m.target_device_types) or _("any")),
        (_("Min memory"), _("{mb} MiB per device").format(mb=m.min_device_memory_mb)),
        (_("Engine"), f"{m.engine} {m.engine_version}".strip()),
        (_("Compile cache"), m.compile_cache or "-"),
        (_("Files"), _("{count}, {size} bytes").format(count=len(m.files), size=m.total_bytes)),
    ]
    for p in m.device_profiles:
        rows.append(
            (
                _("Profile"),
                _("{device} {model} {mb} MiB, dtypes {dtypes}").format(
                    device=f"{p.get('node')}/{p['device_type']}:{p.get('device_id')}",
                    model=p.get("model", ""),
                    mb=p.get("hbm_memory_mb", "?"),
                    dtypes=", ".join(map(str, p.get("supported_dtypes", []))),
                ),
            )
        )
    width = max(len(k) for k, _ in rows)
    for k, val in rows:
        print(f"{k:<{width}}  {val}")
    return 0
