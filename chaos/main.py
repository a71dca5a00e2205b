"""`kunlun-chaos`: the chaos suite.

    kunlun-chaos up   [--dir D]       build the namespace topology and start a cluster on it, leave it up
    kunlun-chaos down                 remove every chaos namespace, with its processes and links
    kunlun-chaos run --profile short|soak --seed N --report DIR
                                      one run: faults, load, checkers, report; exit 1 on a violation

`run` builds the topology here (root), runs the driver inside the client namespace, and removes the
topology afterwards whatever happened (exit 3 when something could not be removed).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

from chaos.netcluster import net_cluster
from chaos.netns import PREFIX, list_namespaces, remove_all, remove_namespaces
from controlplane.cli.config import ClientConfig, write_client_config
from kunlun_common.pki import paths_for


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _run_id() -> str:
    return format(os.getpid() % 0xFFFFFF, "x")


def _in_client(base: Path, run_id: str, argv: list[str], timeout: float) -> int:
    """Build the topology, run argv in its client namespace, and (for `run`) remove it afterwards."""
    topo = net_cluster(base, run_id).net
    topo.up()
    proc = subprocess.Popen(topo.exec_argv("client", [sys.executable, "-m", "chaos.main", *argv]))
    try:
        return proc.wait(timeout)
    except (KeyboardInterrupt, subprocess.TimeoutExpired) as e:
        print(f"kunlun-chaos: stopping the run ({type(e).__name__})", file=sys.stderr)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return 130


def cmd_run(a: argparse.Namespace) -> int:
    from chaos.netns import available

    why = available()
    if why:
        print(f"kunlun-chaos: cannot run here: {why}", file=sys.stderr)
        return 2
    run_id = _run_id()
    base = Path(a.dir).resolve() if a.dir else Path(tempfile.mkdtemp(prefix="kunlun-chaos-"))
    report = Path(a.report).resolve()
    rc = 1
    topo = net_cluster(base, run_id).net
    t = time.monotonic()
    try:
        rc = _in_client(
            base,
            run_id,
            [
                "_drive",
                f"--dir={base}",
                f"--run-id={run_id}",
                f"--profile={a.profile}",
                f"--seed={a.seed}",
                f"--report={report}",
                f"--faults={a.faults}",
            ],
            a.timeout,
        )
    finally:
        removed = topo.down()
        left = [n for n in list_namespaces() if n.startswith(topo.prefix)]
        print(
            f"kunlun-chaos: removed {len(removed)} namespaces (with their links and processes); "
            f"left behind: {', '.join(left) or 'nothing'}; {time.monotonic() - t:.0f}s in all"
        )
        if left:
            rc = rc or 3
        if not a.keep and not a.dir:
            shutil.copytree(
                base,
                report / "logs",
                dirs_exist_ok=True,
                ignore=shutil.ignore_patterns("*.key", "data", "filler"),
            )
            shutil.rmtree(base, ignore_errors=True)
    return rc


def cmd_drive(a: argparse.Namespace) -> int:
    from chaos.runner import drive

    signal.signal(signal.SIGTERM, _interrupt)
    return drive(Path(a.dir), a.run_id, a.profile, a.seed, Path(a.report), a.faults)


def cmd_up(a: argparse.Namespace) -> int:
    from chaos.netns import available

    why = available()
    if why:
        print(f"kunlun-chaos: cannot run here: {why}", file=sys.stderr)
        return 2
    if any(n.startswith("kunlun-chaos-") for n in list_namespaces()):
        print("kunlun-chaos: a chaos topology exists already; `kunlun-chaos down` first", file=sys.stderr)
        return 2
    base = Path(a.dir).resolve()
    base.mkdir(parents=True, exist_ok=True)
    run_id = _run_id()
    rc = _in_client(base, run_id, ["_up", f"--dir={base}", f"--run-id={run_id}"], 600)
    if rc != 0:
        remove_all()
    return rc


def cmd_up_inside(a: argparse.Namespace) -> int:
    cluster = net_cluster(Path(a.dir), a.run_id)
    try:
        cluster.start()
    except Exception as e:
        print(f"kunlun-chaos up: the cluster failed to start: {e}; logs under {a.dir}", file=sys.stderr)
        cluster.stop()
        return 1
    p = paths_for(cluster.cert_dir, "operator", "admin")
    cfg = Path(a.dir) / "client.yaml"
    write_client_config(cfg, ClientConfig(tuple(cluster.endpoints), str(p.ca), str(p.cert), str(p.key)))
    client_ns = cluster.net.hosts["client"].ns
    print("hosts:")
    for h in cluster.net.hosts.values():
        print(f"  {h.name:10s} {h.addr:14s} netns {h.ns}")
    print(f"leader: {cluster.leader()}; gateways: {', '.join(cluster.gateway_addrs.values())}")
    print(
        f"use it: ip netns exec {client_ns} env KUNLUN_CONFIG={cfg} {Path(sys.executable).parent}/kunlun-cli device list"
    )
    print("stop it: kunlun-chaos down")
    return 0


def cmd_down(a: argparse.Namespace) -> int:
    prefix = f"{PREFIX}{a.run_id}-" if a.run_id else PREFIX
    removed = remove_namespaces([n for n in list_namespaces() if n.startswith(prefix)])
    left = [n for n in list_namespaces() if n.startswith(prefix)]
    print(f"removed {len(removed)} namespaces" + (f"; could not remove {', '.join(left)}" if left else ""))
    return 1 if left else 0


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="kunlun-chaos", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="one chaos run with a report")
    r.add_argument("--profile", choices=["short", "soak"], default="short")
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--report", default="chaos-report", help="folder for report.md, report.json, timeline.png")
    r.add_argument("--dir", help="state folder (default: a temporary folder, removed after the run)")
    r.add_argument("--keep", action="store_true", help="keep the temporary state folder")
    r.add_argument("--timeout", type=float, default=3600.0, help="stop the run after this many seconds")
    r.add_argument("--faults", type=int, default=0, help="number of faults (default: the profile's)")
    u = sub.add_parser("up", help="start a cluster on a namespace topology and leave it running")
    u.add_argument("--dir", default=".kunlun-chaos", help="state folder (default .kunlun-chaos)")
    dn = sub.add_parser("down", help="remove every chaos namespace with its processes and links")
    dn.add_argument("--run-id", help="only this run's namespaces (kunlun-chaos-<RUN_ID>-*)")
    d = sub.add_parser("_drive")
    for arg in ("--dir", "--run-id", "--profile", "--report"):
        d.add_argument(arg, required=True)
    d.add_argument("--seed", type=int, required=True)
    d.add_argument("--faults", type=int, default=0)
    ui = sub.add_parser("_up")
    ui.add_argument("--dir", required=True)
    ui.add_argument("--run-id", required=True)
    a = ap.parse_args()
    handlers = {"run": cmd_run, "_drive": cmd_drive, "up": cmd_up, "_up": cmd_up_inside, "down": cmd_down}
    if a.command in ("run", "up"):
        signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(handlers[a.command](a))


if __name__ == "__main__":
    main()
