"""`kunlun-cli`: the operator's tool. Every command takes `-o table|json` and `--endpoints`.

Errors are one line on stderr with a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

from controlplane.cli import (
    audit_cmd,
    certs_cmd,
    cluster_cmd,
    declaration_cmd,
    device_cmd,
    endpoint_cmd,
    gateway_cmd,
    model_cmd,
    node_cmd,
    node_engines_cmd,
    rollout_cmd,
    scheduler_cmd,
    telemetry_cmd,
    workload_cmd,
)
from controlplane.cli.client import Client, CliError
from controlplane.cli.config import default_path, load_client_config
from controlplane.cli.localize import localized
from controlplane.cli.verify import command as verify_cmd
from kunlun_common.errors import ConfigError, KunlunError
from kunlun_common.i18n import _, error_text

Handler = Callable[[argparse.Namespace], int]


def make_client(args: argparse.Namespace) -> Client:
    path = Path(args.config) if args.config else default_path()
    if args.endpoints and not path.exists():
        raise CliError(
            _(
                "client config {path} does not exist; it names the certificates (run `make demo` or write it)"
            ).format(path=path)
        )
    try:
        cfg = load_client_config(path)
    except ConfigError as e:
        if not path.exists():
            raise CliError(
                _(
                    "no client config at {path}: run `make demo` (which writes it), set KUNLUN_CONFIG, "
                    "or pass --config"
                ).format(path=path)
            ) from None
        raise CliError(str(e)) from None
    if args.endpoints:
        eps = tuple(e.strip() for e in args.endpoints.split(",") if e.strip())
        cfg = dataclasses.replace(cfg, endpoints=eps)
    if args.crl:
        cfg = dataclasses.replace(cfg, crl=args.crl)
    return Client(cfg, timeout_s=args.timeout)


def _common(suppress: bool) -> argparse.ArgumentParser:
    """Global options, accepted before or after the command (sub-commands must not reset them)."""

    def d(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    c = argparse.ArgumentParser(add_help=False)
    c.add_argument("-o", "--output", choices=["table", "json"], default=d("table"), help="output format")
    c.add_argument(
        "--endpoints", default=d(None), help="comma-separated replica addresses (overrides the client config)"
    )
    c.add_argument(
        "--config",
        default=d(None),
        help="client config (default $KUNLUN_CONFIG or ~/.config/kunlun/config.yaml)",
    )
    c.add_argument(
        "--crl",
        default=d(None),
        help="revocation list (CRL file): refuse replicas presenting a listed certificate "
        "(default: the client config's crl, else crl/etcd.crl beside the CA)",
    )
    c.add_argument("--timeout", type=float, default=d(5.0), help="seconds per replica before trying the next")
    return c


def build_parser() -> argparse.ArgumentParser:
    common = _common(suppress=True)
    p = argparse.ArgumentParser(
        prog="kunlun-cli", description="Operate a Kunlun Platform cluster.", parents=[_common(False)]
    )
    sub = p.add_subparsers(dest="group", required=True)
    device_cmd.register(sub, common)
    node_cmd.register(sub, common)
    cluster_cmd.register(sub, common)
    certs_cmd.register(sub, common)
    audit_cmd.register(sub, common)
    workload_cmd.register(sub, common)
    gateway_cmd.register(sub, common)
    endpoint_cmd.register(sub, common)
    rollout_cmd.register(sub, common)
    scheduler_cmd.register(sub, common)
    telemetry_cmd.register(sub, common)
    model_cmd.register(sub, common)
    declaration_cmd.register(sub, common)
    node_engines_cmd.register(sub, common)
    verify_cmd.register(sub, common)
    return p


def main(argv: list[str] | None = None) -> None:
    parser = localized(build_parser)  # help and messages in the reader's language (LANG=zh_CN...)
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    try:
        code = handler(args)
    except (CliError, KunlunError) as e:
        print(_("kunlun-cli: {text}").format(text=error_text(e)), file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:  # e.g. `kunlun-cli ... | head`
        code = 0
    sys.exit(code)


if __name__ == "__main__":
    main()
