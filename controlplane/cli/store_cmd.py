"""`kunlun-cli model push|list|delete`: the cluster's package store.

`push` reads the file once and streams it to two replicas at the same time (the first two endpoints
of the client config that keep packages), so the store holds two verified copies; it fails unless
both accept. `delete` asks every replica to drop its copy; the index entry goes with the last.
"""

from __future__ import annotations

import argparse
import queue
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from controlplane.cli.client import CliError
from controlplane.cli.output import print_json, print_table
from kunlun_common.api import package_pb2, package_pb2_grpc
from kunlun_common.i18n import _

CHUNK = 1 << 20
COPIES = 2


def register(msub: Any, common: argparse.ArgumentParser) -> None:
    p = msub.add_parser("push", help="upload a package to the cluster store (two replicas)", parents=[common])
    p.add_argument("package", help="the .kunlunpkg file")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(handler=model_push)
    ls = msub.add_parser("list", help="packages in the cluster store", parents=[common])
    ls.set_defaults(handler=model_list)
    d = msub.add_parser("delete", help="remove a package from the cluster store", parents=[common])
    d.add_argument("ref", help="NAME@sha256:DIGEST or sha256:DIGEST")
    d.set_defaults(handler=model_delete)


def info_json(p: package_pb2.PackageInfo) -> dict[str, Any]:
    return {
        "name": p.name,
        "version": p.version,
        "digest": p.digest,
        "ref": f"{p.name}@{p.digest}",
        "size_bytes": p.size_bytes,
        "weight_format": p.weight_format,
        "quantization": p.quantization,
        "min_device_memory_mb": p.min_device_memory_mb,
        "engine": p.engine,
        "target_device_types": list(p.target_device_types),
        "signed_by": p.signed_by,
        "pushed_by": p.pushed_by,
        "pushed_at_unix_ms": p.pushed_at_unix_ms,
        "holders": list(p.holders),
    }


def _chunks(q: queue.Queue[bytes | None]) -> Iterator[package_pb2.PushPackageChunk]:
    while (item := q.get()) is not None:
        yield package_pb2.PushPackageChunk(data=item)


def model_push(args: argparse.Namespace) -> int:
    from controlplane.cli.main import make_client

    path = Path(args.package)
    if not path.is_file():
        raise CliError(_("{path}: no such file").format(path=path))
    client = make_client(args)
    targets = list(client.cfg.endpoints[:COPIES])
    size = path.stat().st_size
    deadline = max(args.timeout, 60.0 + size / 20e6)  # at least 20 MB/s
    queues: list[queue.Queue[bytes | None]] = [queue.Queue(maxsize=8) for _ in targets]
    results: list[package_pb2.PackageInfo | None] = [None] * len(targets)
    errors: list[str] = [""] * len(targets)

    def send(i: int) -> None:
        try:
            with client.channel(targets[i]) as ch:
                results[i] = package_pb2_grpc.PackageServiceStub(ch).PushPackage(
                    _chunks(queues[i]), timeout=deadline
                )
        except grpc.RpcError as e:
            errors[i] = f"{targets[i]}: {e.code().name.lower().replace('_', ' ')}: {e.details()}"

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(len(targets))]
    for t in threads:
        t.start()
    sent, last = 0, 0.0
    with path.open("rb") as f:
        while data := f.read(CHUNK):
            for i, q in enumerate(queues):
                while threads[i].is_alive():
                    try:
                        q.put(data, timeout=0.5)
                        break
                    except queue.Full:
                        continue
            sent += len(data)
            if not args.quiet and time.monotonic() - last > 2.0:
                last = time.monotonic()
                print(
                    _("pushing {value:3d}%  {value2:.2f} / {value3:.2f} GB").format(
                        value=100 * sent // max(size, 1),
                        value2=sent / 1000000000.0,
                        value3=size / 1000000000.0,
                    ),
                    file=sys.stderr,
                )
    for i, q in enumerate(queues):
        if threads[i].is_alive():
            q.put(None)
    for t in threads:
        t.join()
    failed = [e for e in errors if e]
    if failed:
        raise CliError(_("push refused: {items}").format(items="; ".join(failed)))
    if len(targets) < COPIES:
        print(
            _("kunlun-cli: warning: only {count} replica endpoint configured; one copy stored").format(
                count=len(targets)
            ),
            file=sys.stderr,
        )
    final = max((r for r in results if r is not None), key=lambda r: len(r.holders))
    if args.output == "json":
        print_json(info_json(final))
    else:
        print(
            _("stored {name}@{digest} on {items}").format(
                name=final.name, digest=final.digest, items=", ".join(final.holders)
            )
        )
    return 0


def model_list(args: argparse.Namespace) -> int:
    from controlplane.cli.main import make_client

    client = make_client(args)
    packages = client.pages(
        package_pb2_grpc.PackageServiceStub,
        lambda s: s.ListPackages,
        package_pb2.ListPackagesRequest(),
        "packages",
    )
    packages.sort(key=lambda p: (p.name, p.pushed_at_unix_ms))
    if args.output == "json":
        print_json({"items": [info_json(p) for p in packages]})
        return 0
    rows = [
        (p.name, p.version, p.digest[:19] + "…", p.size_bytes, p.weight_format, p.quantization or "-",
         p.min_device_memory_mb, p.signed_by or "UNSIGNED", ",".join(p.holders))
        for p in packages
    ]  # fmt: skip
    print_table(
        ["NAME", "VERSION", "DIGEST", "BYTES", "FORMAT", "QUANT", "MIN MiB", "SIGNED BY", "HOLDERS"], rows
    )
    return 0


def model_delete(args: argparse.Namespace) -> int:
    from controlplane.cli.main import make_client

    client = make_client(args)
    last: package_pb2.PackageInfo | None = None
    problems: list[str] = []
    for ep in client.cfg.endpoints:  # every replica drops its own copy
        why = client.refused(ep)
        if why:
            problems.append(f"{ep}: {why}")
            continue
        with grpc.secure_channel(ep, client.creds) as ch:
            try:
                last = package_pb2_grpc.PackageServiceStub(ch).DeletePackage(
                    package_pb2.DeletePackageRequest(ref=args.ref), timeout=args.timeout
                )
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    problems.append(f"{ep}: {e.code().name.lower().replace('_', ' ')}: {e.details()}")
    if problems:
        raise CliError(_("delete incomplete: {items}").format(items="; ".join(problems)))
    if last is None:
        raise CliError(_("no package {ref} in the store; see `kunlun-cli model list`").format(ref=args.ref))
    if args.output == "json":
        print_json(info_json(last))
    else:
        print(_("deleted {name}@{digest}").format(name=last.name, digest=last.digest))
    return 0
