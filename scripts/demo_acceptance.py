"""`make demo-check`: the acceptance checks of the trust, node-loss and verify issues, run against
the cluster `make demo` started (its state folder, `.kunlun/` by default), as an operator and an
attacker would run them by hand.

1. **etcd is for replicas only** (`etcdctl`, Debian's etcd-client): every certificate the cluster
   CA issued (viewer, operator, agent, gateway, monitoring) tries `put` and `del` on each etcd
   member and must be refused; the replicas' etcd certificate may read and write the cluster
   prefix and nothing outside it.
2. **A frozen agent** (SIGSTOP): a one-instance workload serves; its node's agent is frozen;
   the instance stays on the node at least the node lease plus `node_not_ready_grace_seconds`; the
   old engine stops by itself (the node's engine ledger) before the replacement starts elsewhere;
   the replacement answers a completion; no two engines of the instance were ever alive together.
   The agent is resumed afterwards and the workload removed.
3. **`kunlun-cli verify --layer 1..5 --disruptive --report DIR`** exits 0; its summary is printed.

Prints one line per check (PASS/FAIL, measured value, evidence), writes `summary.json` into the
report folder, and exits 0 only when every check passed. Touches nothing but what it creates
(workload `accept-loss`), the frozen agent (resumed in every case) and what verify creates and
removes itself.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from node_agent.executor.ledger import OPEN, overlap_s, runs_of


@dataclass
class Check:
    name: str
    passed: bool
    value: str
    evidence: str


def _cli(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cli = Path(sys.executable).parent / "kunlun-cli"
    return subprocess.run([str(cli), *args], capture_output=True, text=True, timeout=timeout, check=False)


def _cli_json(args: list[str]) -> Any:
    r = _cli([*args, "-o", "json"])
    if r.returncode != 0:
        raise RuntimeError(f"kunlun-cli {' '.join(args)}: exit {r.returncode}: {r.stderr.strip()[:300]}")
    return json.loads(r.stdout)


def _wait(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    end = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < end:
        try:
            got = pred()
            if got:
                return got
        except Exception as e:  # the cluster may be between states; try again until the deadline
            last = e
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}" + (f" ({last})" if last else ""))


# ------------------------------------------------------------------ 1. etcd as an attacker
def etcd_checks(base: Path, endpoints: list[str]) -> list[Check]:
    certs = base / "certs"
    etcd_ca = certs / "etcd-ca.crt"
    out: list[Check] = []

    def ctl(cert: Path, key: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                "etcdctl",
                f"--endpoints={','.join(endpoints)}",
                f"--cacert={etcd_ca}",
                f"--cert={cert}",
                f"--key={key}",
                "--dial-timeout=3s",
                "--command-timeout=5s",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            env={**os.environ, "ETCDCTL_API": "3"},
        )

    for role in ("viewer", "operator", "agent", "gateway", "monitoring"):
        for crt in sorted((certs / role).glob("*.crt")):
            key = crt.with_suffix(".key")
            put = ctl(crt, key, "put", "/kunlun/v1/accept-attack", "x")
            dele = ctl(crt, key, "del", "--prefix", "/kunlun/")
            refused = put.returncode != 0 and dele.returncode != 0
            why = (put.stderr.strip().splitlines() or ["(no error)"])[-1][:160]
            out.append(
                Check(
                    f"etcd refuses {role}/{crt.stem}",
                    refused,
                    "put/del refused"
                    if refused
                    else f"put exit {put.returncode}, del exit {dele.returncode}",
                    why,
                )
            )
    kc, kk = certs / "etcd-client" / "kunlun.crt", certs / "etcd-client" / "kunlun.key"
    inside = ctl(kc, kk, "get", "--prefix", "--keys-only", "--limit=1", "/kunlun/")
    outside = ctl(kc, kk, "put", "/outside-the-prefix", "x")
    ok = inside.returncode == 0 and outside.returncode != 0
    out.append(
        Check(
            "replicas' etcd user: cluster prefix only",
            ok,
            f"read inside exit {inside.returncode}, write outside exit {outside.returncode}",
            (outside.stderr.strip().splitlines() or ["(no error)"])[-1][:160],
        )
    )
    return out


# ------------------------------------------------------------------ 2. a frozen agent
def _instance(name: str) -> dict[str, Any] | None:
    d = _cli_json(["workload", "describe", name])
    insts = d.get("instance_details") or []
    return insts[0] if insts else None


def _answers(endpoint: str, model: str) -> bool:
    body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 1}).encode()
    req = urllib.request.Request(
        f"http://{endpoint}/v1/completions", body, {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            return int(r.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def node_loss_check(base: Path, types: str) -> list[Check]:
    state = json.loads((base / "cluster.json").read_text())
    cfg = _cli_json(["scheduler", "config", "get"])
    grace = float(cfg.get("node_not_ready_grace_seconds", 0))
    name = "accept-loss"
    _cli(["workload", "delete", name])
    r = _cli(
        [
            "workload",
            "submit",
            "--name",
            name,
            "--model",
            "m",
            "--replicas",
            "1",
            "--preferred-device-types",
            types,
        ]
    )
    if r.returncode != 0:
        raise RuntimeError(f"submit failed: {r.stderr.strip()[:300]}")
    checks: list[Check] = []
    try:
        first = _wait(
            lambda: (i := _instance(name)) and i.get("phase") == "Running" and i.get("endpoint") and i,
            120,
            f"{name} Running",
        )
        iid, node = first["id"], first["node"]
        pid = int(state["pids"][f"agent-{node}"])
        t0 = time.monotonic()
        t0_ns = time.monotonic_ns()
        os.kill(pid, signal.SIGSTOP)
        marks: dict[str, float] = {}
        try:
            end = t0 + 90
            while time.monotonic() < end and "serving" not in marks:
                cur = _instance(name)
                if cur and cur.get("node") and cur["node"] != node:
                    marks.setdefault("moved", time.monotonic() - t0)
                    if (
                        cur.get("phase") == "Running"
                        and cur.get("endpoint")
                        and _answers(cur["endpoint"], "m")
                    ):
                        marks["serving"] = time.monotonic() - t0
                time.sleep(0.1)
        finally:
            os.kill(pid, signal.SIGCONT)
        runs = runs_of({f.name: f for f in sorted((base / "agents").iterdir()) if f.is_dir()}, iid)
        old = [r for r in runs if r[0] == node]
        new = [r for r in runs if r[0] != node]
        fenced = [(stop - t0_ns) / 1e9 for _, _, stop in old if stop < OPEN]
        overlap = overlap_s(runs)
        moved = marks.get("moved", float("nan"))
        serving = marks.get("serving", float("nan"))
        checks.append(
            Check(
                "frozen agent: no move before the grace",
                moved >= grace,
                f"moved after {moved:.1f} s (grace {grace:g} s)",
                f"instance {iid} left {node}",
            )
        )
        checks.append(
            Check(
                "frozen agent: old engine fenced itself first",
                bool(fenced) and bool(new) and max(fenced) * 1e9 + t0_ns <= min(s for _, s, _ in new),
                f"fenced at {max(fenced):.1f} s" if fenced else "old engine never stopped",
                f"ledgers: {len(old)} run(s) on {node}, {len(new)} elsewhere",
            )
        )
        checks.append(
            Check(
                "frozen agent: replacement serving, overlap 0",
                serving == serving and overlap <= 0,
                f"serving after {serving:.1f} s, overlap {overlap:.3f} s",
                "completion answered 200 at the new endpoint",
            )
        )
    finally:
        _cli(["workload", "delete", name])
        _wait(
            lambda: all(n.get("ready") for n in _cli_json(["node", "list"]).get("items", [])),
            60,
            "every node Ready again",
        )
    return checks


# ------------------------------------------------------------------ 3. kunlun-cli verify
def verify_check(report: Path) -> list[Check]:
    r = _cli(["verify", "--layer", "1..5", "--disruptive", "--report", str(report)], timeout=1800)
    summary = ""
    data = report / "report.json"
    if data.exists():
        doc = json.loads(data.read_text())
        summary = json.dumps(doc.get("summary", doc.get("layers", "")))[:400]
    print(r.stdout[-4000:])
    return [
        Check(
            "kunlun-cli verify --layer 1..5 --disruptive", r.returncode == 0, f"exit {r.returncode}", summary
        )
    ]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m scripts.demo_acceptance", description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=".kunlun", help="the state folder of `make demo` (default .kunlun)")
    ap.add_argument("--report", default="demo-acceptance", help="folder for verify's report and summary.json")
    ap.add_argument(
        "--types",
        default="ascend,cambricon",
        help="preferred device types of the node-loss workload (its node's agent is frozen; it moves to the next)",
    )
    ap.add_argument("--skip", default="", help="comma-separated checks to skip: etcd, node-loss, verify")
    a = ap.parse_args()
    base = Path(a.dir).resolve()
    state_file = base / "cluster.json"
    if not state_file.exists():
        print(
            f"demo-check: {state_file} not found: start the cluster with `make demo` first", file=sys.stderr
        )
        sys.exit(2)
    state = json.loads(state_file.read_text())
    report = Path(a.report).resolve()
    report.mkdir(parents=True, exist_ok=True)
    skip = {s.strip() for s in a.skip.split(",") if s.strip()}
    checks: list[Check] = []
    stages: list[tuple[str, Callable[[], list[Check]]]] = [
        ("etcd", lambda: etcd_checks(base, [f"https://{e.split('://')[-1]}" for e in state["etcd"]])),
        ("node-loss", lambda: node_loss_check(base, a.types)),
        ("verify", lambda: verify_check(report)),
    ]
    for stage, run in stages:
        if stage in skip:
            continue
        print(f"[{stage}] ...", flush=True)
        try:
            got = run()
        except Exception as e:  # a stage that cannot run is a failed check, named, not a traceback
            got = [Check(stage, False, "could not run", f"{type(e).__name__}: {e}"[:300])]
        for c in got:
            print(f"  {'PASS' if c.passed else 'FAIL'}  {c.name}: {c.value}  ({c.evidence})", flush=True)
        checks += got
    (report / "summary.json").write_text(json.dumps([asdict(c) for c in checks], indent=2))
    failed = [c for c in checks if not c.passed]
    print(
        f"\n{len(checks) - len(failed)} of {len(checks)} checks passed; summary in {report / 'summary.json'}"
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
