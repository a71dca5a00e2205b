"""`kunlun-cli declaration sign|verify`: detached signatures of device declarations.

An agent started with `--require-signed-config --trusted-keys DIR` loads device-plugin-config.yaml
only when `device-plugin-config.yaml.sig` (written by `declaration sign`) verifies with a key in DIR.
`verify` exit codes: 0 valid, 1 could not run, 3 unsigned, changed or untrusted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from controlplane.cli.model_cmd import default_trust_dir
from controlplane.cli.output import print_json
from kunlun_common.i18n import _, error_text
from kunlun_common.modelpkg import PackageError, TrustedKeys, load_private_key
from kunlun_common.modelpkg.detached import read_verified, sign_file


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    d = sub.add_parser("declaration", help="sign and check device declarations", parents=[common])
    dsub = d.add_subparsers(dest="cmd", required=True)
    s = dsub.add_parser("sign", help="write FILE.sig, an Ed25519 signature of FILE", parents=[common])
    s.add_argument("file", help="a device-plugin-config.yaml")
    s.add_argument("--sign-key", required=True, help="private key from `kunlun-cli model keygen`")
    s.set_defaults(handler=declaration_sign)
    v = dsub.add_parser("verify", help="check FILE.sig against trusted keys", parents=[common])
    v.add_argument("file")
    v.add_argument(
        "--trusted-key", action="append", default=[], help="a trusted public key (.pub), repeatable"
    )
    v.add_argument(
        "--trust-dir", help="folder of trusted *.pub (default: trusted-keys/ beside the client config)"
    )
    v.set_defaults(handler=declaration_verify)


def declaration_sign(args: argparse.Namespace) -> int:
    key = load_private_key(Path(args.sign_key))
    try:
        out = sign_file(Path(args.file), key)
    except PackageError as e:
        print(_("kunlun-cli: {e}").format(e=error_text(e)), file=sys.stderr)
        return 1
    if args.output == "json":
        print_json({"file": args.file, "signature": str(out)})
    else:
        print(_("wrote {out}").format(out=out))
    return 0


def declaration_verify(args: argparse.Namespace) -> int:
    trust_dir = Path(args.trust_dir) if args.trust_dir else default_trust_dir()
    trusted = TrustedKeys.load([Path(k) for k in args.trusted_key], [trust_dir])
    try:
        _data, kid = read_verified(Path(args.file), trusted)
    except PackageError as e:
        print(_("kunlun-cli: {e}").format(e=error_text(e)), file=sys.stderr)
        return e.exit_code
    if args.output == "json":
        print_json({"file": args.file, "ok": True, "signed_by": kid})
    else:
        print(_("OK {file}: signed by trusted key {kid}").format(file=args.file, kid=kid))
    return 0
