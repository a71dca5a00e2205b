"""`kunlun-cli model trust add|remove|list`: the cluster's trusted package-signing keys (operators), and
`kunlun-cli model policy get|set`: the cluster's package policy (`require_signed_packages`)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from controlplane.cli.client import CliError
from controlplane.cli.output import print_json, print_table
from kunlun_common.api import package_pb2, package_pb2_grpc
from kunlun_common.i18n import _, error_text


def register(msub: Any, common: argparse.ArgumentParser) -> None:
    t = msub.add_parser("trust", help="the cluster's trusted package-signing keys", parents=[common])
    tsub = t.add_subparsers(dest="trust_cmd", required=True)
    a = tsub.add_parser(
        "add", help="trust a public key (.pub from `model keygen`); audited", parents=[common]
    )
    a.add_argument("public_key", help="the .pub file")
    a.add_argument("--name", default="", help="a label, e.g. the signing team")
    a.set_defaults(handler=trust_add)
    r = tsub.add_parser("remove", help="stop trusting a key (by key id); audited", parents=[common])
    r.add_argument("key_id", help="ed25519:... as shown by `model trust list`")
    r.set_defaults(handler=trust_remove)
    ls = tsub.add_parser("list", help="trusted keys: id, name, who added it and when", parents=[common])
    ls.set_defaults(handler=trust_list)
    pol = msub.add_parser("policy", help="the cluster's package policy", parents=[common])
    psub = pol.add_subparsers(dest="policy_cmd", required=True)
    g = psub.add_parser("get", help="show the package policy, who set it and when", parents=[common])
    g.set_defaults(handler=policy_get)
    st = psub.add_parser("set", help="change the package policy (operators); audited", parents=[common])
    st.add_argument(
        "--require-signed-packages",
        choices=["on", "off"],
        required=True,
        help="on: every node launches only packages signed by a key the cluster trusts",
    )
    st.set_defaults(handler=policy_set)


def _json(k: package_pb2.TrustedKey) -> dict[str, Any]:
    return {
        "key_id": k.key_id,
        "name": k.name,
        "added_by": k.added_by,
        "added_at_unix_ms": k.added_at_unix_ms,
        "public_key_pem": k.public_key_pem,
    }


def _call(args: argparse.Namespace, method: str, request: Any) -> Any:
    from controlplane.cli.main import make_client

    client = make_client(args)
    return client.call_stub(package_pb2_grpc.PackageServiceStub, lambda s: getattr(s, method), request)


def trust_add(args: argparse.Namespace) -> int:
    try:
        pem = Path(args.public_key).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(
            _("{public_key}: cannot read the public key ({e})").format(
                public_key=args.public_key, e=error_text(e)
            )
        ) from None
    k = _call(args, "AddTrustedKey", package_pb2.AddTrustedKeyRequest(public_key_pem=pem, name=args.name))
    if args.output == "json":
        print_json(_json(k))
    else:
        print(_("trusted {key_id} {name}").format(key_id=k.key_id, name=k.name).rstrip())
    return 0


def trust_remove(args: argparse.Namespace) -> int:
    k = _call(args, "RemoveTrustedKey", package_pb2.RemoveTrustedKeyRequest(key_id=args.key_id))
    if args.output == "json":
        print_json(_json(k))
    else:
        print(_("no longer trusted: {key_id} {name}").format(key_id=k.key_id, name=k.name).rstrip())
    return 0


def trust_list(args: argparse.Namespace) -> int:
    resp = _call(args, "ListTrustedKeys", package_pb2.ListTrustedKeysRequest())
    if args.output == "json":
        print_json({"items": [_json(k) for k in resp.keys]})
        return 0
    rows = [
        (
            k.key_id,
            k.name or "-",
            k.added_by,
            time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(k.added_at_unix_ms / 1000)),
        )
        for k in resp.keys
    ]
    print_table(["KEY ID", "NAME", "ADDED BY", "ADDED (UTC)"], rows)
    return 0


def _policy_json(p: package_pb2.PackagePolicy) -> dict[str, Any]:
    return {
        "require_signed_packages": p.require_signed_packages,
        "updated_by": p.updated_by,
        "updated_at_unix_ms": p.updated_at_unix_ms,
    }


def _print_policy(args: argparse.Namespace, p: package_pb2.PackagePolicy) -> None:
    if args.output == "json":
        print_json(_policy_json(p))
        return
    state = "on" if p.require_signed_packages else "off"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(p.updated_at_unix_ms / 1000))
    print(
        (
            _("require_signed_packages: {state}  (set by {by} at {when} UTC)")
            if p.updated_by
            else _("require_signed_packages: {state}")
        ).format(state=state, by=p.updated_by, when=when)
    )


def policy_get(args: argparse.Namespace) -> int:
    _print_policy(args, _call(args, "GetPackagePolicy", package_pb2.GetPackagePolicyRequest()))
    return 0


def policy_set(args: argparse.Namespace) -> int:
    req = package_pb2.SetPackagePolicyRequest(require_signed_packages=args.require_signed_packages == "on")
    _print_policy(args, _call(args, "SetPackagePolicy", req))
    return 0
