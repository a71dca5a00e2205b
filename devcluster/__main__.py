"""`python -m devcluster up|down` — the launcher behind `make demo` / `make down`."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from controlplane.cli.config import ClientConfig, default_path, write_client_config
from devcluster.cluster import ClusterSpec, LocalCluster, kept_ports, stop_from_state
from kunlun_common.pki import paths_for

DEMO_REPLICA_PORTS = (50051, 50052, 50053)
DEMO_ETCD_PORTS = ((23791, 23801), (23792, 23802), (23793, 23803))


def up(base: Path, free_ports: bool = False) -> int:
    kept = kept_ports(base)
    if (base / "cluster.json").exists():
        stopped = stop_from_state(base)
        if stopped:
            print(f"stopped the previous local cluster ({len(stopped)} processes)")
    # the demo's logs are for people: readable lines (production and the tests keep JSON)
    if free_ports and kept is not None:
        # etcd's members keep the peer URLs they were created with: start on the same ports again
        spec = ClusterSpec(
            base_dir=base,
            replica_ports=kept[1],
            etcd_ports=kept[0],
            log_format="console",
            supervise_replicas=True,
        )
    elif free_ports:
        spec = ClusterSpec(base_dir=base, log_format="console", supervise_replicas=True)
    else:
        spec = ClusterSpec(
            base_dir=base,
            replica_ports=DEMO_REPLICA_PORTS,
            etcd_ports=DEMO_ETCD_PORTS,
            log_format="console",
            supervise_replicas=True,  # a drained replica is started again (systemd: Restart=always)
        )
    cluster = LocalCluster(spec)
    base.mkdir(parents=True, exist_ok=True)
    print("[1/5] certificates ...", flush=True)
    cluster.make_certs()
    print("[2/5] etcd: 3 members with TLS ...", flush=True)
    try:
        cluster.start_etcd()
        print("[3/5] control plane: 3 replicas ...", flush=True)
        cluster.start_replicas()
        print(
            "[4/5] node agents: node-a (4 x Ascend 910B), node-b (2 x MLU370 + 1 x NVIDIA), simulated ...",
            flush=True,
        )
        cluster.start_agents()
        print("      inference gateways: 3 (OpenAI-compatible HTTP) ...", flush=True)
        cluster.start_gateways()
    except Exception as e:
        print(
            f"local cluster failed to start: {e}\nlogs are under {base}; `make down` stops what started",
            file=sys.stderr,
        )
        return 1
    p = paths_for(cluster.cert_dir, "operator", "admin")
    cfg_path = default_path()
    write_client_config(cfg_path, ClientConfig(tuple(cluster.endpoints), str(p.ca), str(p.cert), str(p.key)))
    print(f"[5/5] client config written to {cfg_path}", flush=True)
    print(f"\nleader: {cluster.leader()}   logs: {base}")
    print(
        "gateways (plain HTTP without API keys, on loopback: development only; production gateways "
        "serve HTTPS and require keys): " + ", ".join(f"http://{a}" for a in cluster.gateway_addrs.values())
    )
    ca, cert, key = cluster.monitoring_tls()
    print(
        f"metrics (HTTPS; client certificate {cert} with key {key}; "
        f"servers signed by {ca} and {ca.with_name('replica-ca.crt')}):"
    )
    for proc, addr in cluster.metrics_addrs.items():
        print(f"  {proc:<16} https://{addr}/metrics")
    print("  Prometheus targets: kunlun-cli telemetry targets > targets.json (deploy/monitoring/)")
    print(
        "run-time profiles (Chrome traces): `kunlun-cli scheduler config set advanced_profiling=true` "
        f"writes them to {cluster.profile_dir}; `advanced_profiling=false` stops\n"
    )
    cli = Path(sys.executable).parent / "kunlun-cli"
    env = {**os.environ, "KUNLUN_CONFIG": str(cfg_path)}
    settled(cli, env)
    subprocess.run([str(cli), "device", "list"], check=False, env=env)
    return 0


def settled(cli: Path, env: dict[str, str], timeout: float = 60.0) -> bool:
    """Wait (bounded) until the very call the demo prints from (`kunlun-cli device list`) shows no
    device Unavailable: over kept state, records of the previous run can still turn a node's
    devices Unavailable for a moment after the agents registered again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = subprocess.run(
            [str(cli), "device", "list", "-o", "json"], capture_output=True, text=True, env=env, timeout=30
        )
        try:
            items = json.loads(r.stdout)["items"] if r.returncode == 0 else []
        except (ValueError, KeyError):
            items = []
        if items and all(d.get("status") != "Unavailable" for d in items):
            return True
        time.sleep(0.5)  # a poll of another process's answer: there is no event to wait on
    return False


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m devcluster")
    ap.add_argument("command", choices=["up", "down"])
    ap.add_argument("--dir", default=".kunlun", help="state folder (default .kunlun)")
    ap.add_argument("--free-ports", action="store_true", help="pick free ports instead of 50051-3 / 23791-3")
    a = ap.parse_args()
    base = Path(a.dir).resolve()
    if a.command == "up":
        sys.exit(up(base, a.free_ports))
    stopped = stop_from_state(base)
    print(f"stopped {len(stopped)} processes" if stopped else "nothing was running")


if __name__ == "__main__":
    main()
