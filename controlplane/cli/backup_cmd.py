"""`kunlun-cli cluster backup FILE` and `cluster restore FILE`: the cluster's state in one file.

Both speak to etcd directly with the administrator's `kunlun-admin` etcd certificate (never through
the replicas): a restore runs while no replica runs, a backup must work when the replicas cannot
start (the usual reason to need one), and a backup holds the whole goal state including workload
environment values, which only the etcd administrator should be able to take out. The file
format and what is left out are documented in controlplane/store/backup_file.py and
controlplane/store/backup.py.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

from controlplane import keys
from controlplane.cli.client import CliError
from controlplane.cli.output import print_json
from controlplane.store.backup import (
    AdminTarget,
    Progress,
    RestorePolicy,
    restorable,
    restore_backup,
    take_backup,
)
from controlplane.store.backup_file import BackupHeader, read_backup, write_backup
from kunlun_common.i18n import _, error_text
from kunlun_common.pki import ETCD_ADMIN

POLICY = RestorePolicy(
    prefix="/kunlun/",
    never=keys.NEVER_RESTORED,
    live=keys.LIVE_MARKERS,
    ordered=(keys.WORKLOADS,),
    marker=keys.RESTORING,
)


def add_etcd_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--etcd-endpoints",
        default=os.environ.get("KUNLUN_ETCD_ENDPOINTS", ""),
        help="etcd client URLs, comma-separated (default $KUNLUN_ETCD_ENDPOINTS; else asked of the replicas)",
    )
    p.add_argument(
        "--etcd-cert-dir",
        default=os.environ.get("KUNLUN_ETCD_CERT_DIR", ""),
        help=f"folder with etcd-ca.crt and etcd-client/{ETCD_ADMIN}.crt|key (default $KUNLUN_ETCD_CERT_DIR)",
    )


def register(csub: Any, common: argparse.ArgumentParser) -> None:
    b = csub.add_parser(
        "backup", help="write the cluster's state (etcd, one revision) to FILE", parents=[common]
    )
    b.add_argument("file", help="the backup file to write (replaced atomically)")
    b.add_argument("--quiet", action="store_true", help="no progress on stderr")
    add_etcd_args(b)
    b.set_defaults(handler=cluster_backup)
    r = csub.add_parser(
        "restore", help="restore a backup FILE into a fresh etcd cluster (replicas stopped)", parents=[common]
    )
    r.add_argument("file", help="a file written by `cluster backup`")
    r.add_argument(
        "--force",
        action="store_true",
        help="restore even if the target holds keys or replicas run against it (they are replaced)",
    )
    r.add_argument("--check", action="store_true", help="only validate the file; touch nothing")
    r.add_argument("--quiet", action="store_true", help="no progress on stderr")
    add_etcd_args(r)
    r.set_defaults(handler=cluster_restore)


def admin_target(args: argparse.Namespace, ask_replicas: bool) -> AdminTarget:
    """The etcd endpoints and admin certificate folder from the flags (or the replicas)."""
    if not args.etcd_cert_dir:
        raise CliError(
            _(
                "--etcd-cert-dir is required: the folder holding etcd-ca.crt and etcd-client/{etcd_admin}.crt|key (the etcd administrator's certificate from `kunlun-cli certs init`), or set KUNLUN_ETCD_CERT_DIR"
            ).format(etcd_admin=ETCD_ADMIN)
        )
    eps = tuple(e.strip() for e in args.etcd_endpoints.split(",") if e.strip())
    if not eps and ask_replicas:
        from controlplane.cli.main import make_client
        from kunlun_common.api import cluster_pb2

        try:
            resp = make_client(args).call(lambda s: s.ClusterStatus, cluster_pb2.ClusterStatusRequest())
        except CliError as e:
            raise CliError(
                _("--etcd-endpoints not given and the replicas could not name them: {e}").format(
                    e=error_text(e)
                )
            ) from None
        eps = tuple(m.endpoint for m in resp.etcd_members if m.endpoint)
    if not eps:
        raise CliError(
            _("--etcd-endpoints is required (https://HOST:2379,...), or set KUNLUN_ETCD_ENDPOINTS")
        )
    return AdminTarget(eps, Path(args.etcd_cert_dir), timeout_s=max(args.timeout, 10.0))


def progress_printer(verb: str, quiet: bool) -> Progress:
    last = [0.0]

    def show(done: int, total: int) -> None:
        now = time.monotonic()
        if quiet or (now - last[0] < 1.0 and done < total):
            return
        last[0] = now
        print(
            _("{verb} {done}/{total} keys ({value}%)").format(
                verb=verb, done=done, total=total, value=100 * done // max(total, 1)
            ),
            file=sys.stderr,
            flush=True,
        )

    return show


def header_json(h: BackupHeader) -> dict[str, Any]:
    return {
        "format_version": h.format_version,
        "kunlun_version": h.kunlun_version,
        "revision": h.revision,
        "cluster_id": h.cluster_id,
        "taken_at": h.taken_at,
        "prefix": h.prefix,
        "keys": h.keys,
        "left_out": dict(h.skipped),
    }


def cluster_backup(args: argparse.Namespace) -> int:
    target = admin_target(args, ask_replicas=True)
    path = Path(args.file)
    if not path.absolute().parent.is_dir():
        raise CliError(
            _("{path}: folder {parent} does not exist; create it or name another FILE").format(
                path=path, parent=path.absolute().parent
            )
        )
    header, records = asyncio.run(take_backup(target, POLICY, progress_printer(_("read"), args.quiet)))
    digest = write_backup(path, header, records)
    size = path.stat().st_size
    if args.output == "json":
        print_json({"file": str(path), "sha256": digest, "bytes": size, **header_json(header)})
    else:
        left = ", ".join(f"{k} {v}" for k, v in sorted(header.skipped.items())) or "none"
        print(
            _(
                "backup {path}: {keys} keys at revision {revision} of etcd cluster {cluster_id}, {size} bytes, sha256 {digest}; left out: {left}"
            ).format(
                path=path,
                keys=header.keys,
                revision=header.revision,
                cluster_id=header.cluster_id,
                size=size,
                digest=digest,
                left=left,
            )
        )
    return 0


def cluster_restore(args: argparse.Namespace) -> int:
    path = Path(args.file)
    header, records = read_backup(path)  # every check before anything is touched
    if args.check:
        if args.output == "json":
            print_json({"file": str(path), "valid": True, **header_json(header)})
        else:
            print(
                _(
                    "{path}: valid; {keys} keys at revision {revision} of etcd cluster {cluster_id}, taken {taken_at} by kunlun {kunlun_version}; {count} would be restored"
                ).format(
                    path=path,
                    keys=header.keys,
                    revision=header.revision,
                    cluster_id=header.cluster_id,
                    taken_at=header.taken_at,
                    kunlun_version=header.kunlun_version,
                    count=len(restorable(records, POLICY)),
                )
            )
        return 0
    target = admin_target(args, ask_replicas=False)
    result = asyncio.run(
        restore_backup(target, header, records, POLICY, args.force, progress_printer(_("wrote"), args.quiet))
    )
    if args.output == "json":
        print_json(
            {
                "file": str(path),
                "written": result.written,
                "left_out": result.left_out,
                "cluster_id": result.cluster_id,
                "revision": result.revision,
                "backup": header_json(header),
            }
        )
    else:
        print(
            _(
                "restored {written} keys from {path} (revision {revision} of etcd cluster {cluster_id}, taken {taken_at}) into etcd cluster {cluster_id2}; {left_out} per-process keys left out. Start the replicas now (systemctl start kunlun-platform); agents reconnect by themselves"
            ).format(
                written=result.written,
                path=path,
                revision=header.revision,
                cluster_id=header.cluster_id,
                taken_at=header.taken_at,
                cluster_id2=result.cluster_id,
                left_out=result.left_out,
            )
        )
    return 0
