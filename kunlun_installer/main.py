"""kunlun-installer: install, verify, repair, upgrade, roll back and run Kunlun Platform on a host.

    kunlun-installer install --role control-plane|worker|gateway|etcd --config FILE --certs DIR --bundle DIR
    kunlun-installer verify [--repair] [--bundle DIR]
    kunlun-installer repair [--bundle DIR]          (the same as verify --repair)
    kunlun-installer upgrade --bundle NEW [--stage | --restart]
    kunlun-installer rollback [--restart]
    kunlun-installer uninstall [--purge]
    kunlun-installer run [--role R ...]             start the installed units' command lines (no systemd)
    kunlun-installer status [-o json]

Exit codes: 0 done (verify: intact), 1 verify found differences, 2 a step failed (its message names
the step and the fix).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kunlun_installer import host, releases
from kunlun_installer.bundle import Bundle
from kunlun_installer.errors import InstallError
from kunlun_installer.units import ROLES


def _paths(a: argparse.Namespace) -> host.Paths:
    return host.Paths(Path(a.prefix), Path(a.etc), Path(a.unit_dir), Path(a.data))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kunlun-installer", description=__doc__.split("\n\n")[0])
    common = argparse.ArgumentParser(add_help=False)
    d = host.Paths()
    common.add_argument("--prefix", default=str(d.prefix), help=f"releases and state (default {d.prefix})")
    common.add_argument("--etc", default=str(d.etc), help=f"configuration and certificates (default {d.etc})")
    common.add_argument("--unit-dir", default=str(d.unit_dir), help=f"systemd units (default {d.unit_dir})")
    common.add_argument("--data", default=str(d.data), help=f"service data (default {d.data})")
    common.add_argument("--bundle", help="an unpacked bundle folder (from make dist)")
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("install", parents=[common], help="install one role on this host")
    i.add_argument("--role", required=True, choices=list(ROLES))
    i.add_argument(
        "--config", required=True, help="the role's config (replica.yaml, device-plugin-config.yaml, ...)"
    )
    i.add_argument("--certs", required=True, help="this host's certificate folder (no CA keys)")
    i.add_argument("--user", default="kunlun", help="service user, created if missing (default kunlun)")
    i.add_argument("--replicas", default="", help="worker: replica addresses host:port,... for the agent")
    v = sub.add_parser("verify", parents=[common], help="check every installed file")
    v.add_argument("--repair", action="store_true", help="restore what differs from the bundle")
    sub.add_parser("repair", parents=[common], help="restore missing or changed files")
    u = sub.add_parser("upgrade", parents=[common], help="install a newer bundle beside and switch to it")
    u.add_argument("--restart", action="store_true", help="restart this host's services afterwards")
    u.add_argument("--stage", action="store_true", help="only build and check the new release; switch later")
    r = sub.add_parser("rollback", parents=[common], help="switch back to the previous release")
    r.add_argument("--restart", action="store_true", help="restart this host's services afterwards")
    x = sub.add_parser(
        "uninstall", parents=[common], help="remove units and releases (keeps config and data)"
    )
    x.add_argument("--purge", action="store_true", help="also remove configuration and data")
    rn = sub.add_parser("run", parents=[common], help="run the installed services without systemd")
    rn.add_argument("--role", action="append", choices=list(ROLES), help="only these roles")
    s = sub.add_parser("status", parents=[common], help="what is installed")
    s.add_argument("-o", "--output", choices=["table", "json"], default="table")
    return p


def _bundle(a: argparse.Namespace, required: bool) -> Bundle | None:
    if not a.bundle:
        if required:
            raise InstallError("arguments", "--bundle missing", "give the unpacked bundle folder")
        return None
    return Bundle.open(a.bundle)


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    paths = _paths(a)
    try:
        if a.cmd == "install":
            bundle = _bundle(a, True)
            assert bundle is not None
            req = host.InstallRequest(a.role, Path(a.config), Path(a.certs), a.user, a.replicas)
            host.install(paths, bundle, req)
        elif a.cmd in ("verify", "repair"):
            if a.cmd == "repair" or a.repair:
                fixed = host.repair(paths, _bundle(a, False))
                print(
                    f"repaired {len(fixed)} problem(s)"
                    if fixed
                    else "nothing to repair: every file as installed"
                )
            else:
                problems = host.verify(paths)
                for line in problems:
                    print(line)
                print(
                    f"{len(problems)} difference(s)" if problems else "ok: every installed file as installed"
                )
                sys.exit(1 if problems else 0)
        elif a.cmd in ("upgrade", "rollback"):
            from kunlun_installer.runner import restart_services

            if a.cmd == "upgrade":
                bundle = _bundle(a, True)
                assert bundle is not None
                releases.upgrade(paths, bundle, a.stage)
            else:
                releases.rollback(paths)
            if a.restart and not (a.cmd == "upgrade" and a.stage):
                print(restart_services(paths))
        elif a.cmd == "uninstall":
            host.uninstall(paths, a.purge)
        elif a.cmd == "run":
            from kunlun_installer.runner import run

            sys.exit(run(paths, a.role))
        elif a.cmd == "status":
            state = host.load_state(paths)
            if a.output == "json":
                out = {k: state.get(k) for k in ("current", "previous", "roles", "user", "paths")}
                print(json.dumps(out, indent=1, sort_keys=True))
            else:
                print(f"current: {state.get('current') or '-'}  previous: {state.get('previous') or '-'}")
                print(f"roles: {', '.join(sorted(state.get('roles') or {})) or '-'}")
    except InstallError as e:
        print(f"kunlun-installer: {e.shown()}", file=sys.stderr)
        sys.exit(2)
