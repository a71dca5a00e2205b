"""The load during a chaos run, as its own process in the client namespace:

- API clients call submit / scale / get / delete on a few shared workload names through one random
  replica per call (no retry: each call's outcome is recorded exactly: ok, failed with a code that
  proves it had no effect, or unknown);
- traffic workers send OpenAI chat requests (non-streaming and streaming) through the gateways,
  retrying on the next gateway like a client with a gateway list, and record the final outcome.

Every loop is bounded in count and in time; the process stops when `--stop-file` appears.
Blocking clients in threads: a load generator, not a service, and simplest to bound per call.

Usage: python -m chaos.clients --endpoints A,B --gateways G,H --cert-dir D --t0 EPOCH --out DIR
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import random
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc

from chaos.history import FAILED, OK, UNKNOWN, ApiOp, ServeOp
from kunlun_common.api import rollout_pb2, rollout_pb2_grpc, workload_pb2, workload_pb2_grpc
from kunlun_common.pki import paths_for
from kunlun_common.tls import channel_credentials, load_tls

# codes that prove a call changed nothing
DEFINITE = {"NOT_FOUND", "FAILED_PRECONDITION", "INVALID_ARGUMENT", "PERMISSION_DENIED", "ALREADY_EXISTS"}
SERVE_WORKLOAD = "chaos-serve"
ROLL_WORKLOAD = "chaos-roll"
ROLL_CLIENT = 100


@dataclass(frozen=True)
class LoadSettings:
    """What the load generator does."""

    endpoints: tuple[str, ...]
    """Replica addresses host:port."""
    gateways: tuple[str, ...]
    """Gateway addresses host:port."""
    cert_dir: Path
    """Certificate folder (the operator `admin` certificate is used)."""
    t0: float
    """Wall-clock epoch seconds that history times are relative to."""
    out: Path
    """Folder for api.jsonl and serve.jsonl."""
    stop_file: Path
    """Stop when this file exists."""
    seed: int = 1
    """Seed of every random choice."""
    api_clients: int = 4
    """Concurrent API clients."""
    traffic_workers: int = 2
    """Concurrent request senders."""
    call_timeout_s: float = 4.0
    """Deadline of one API call."""
    request_timeout_s: float = 4.0
    """Deadline of one HTTP request to one gateway."""
    max_duration_s: float = 900.0
    """Hard bound on the whole run."""
    max_calls: int = 20_000
    """Bound on API calls (all clients together)."""
    max_requests: int = 20_000
    """Bound on HTTP requests."""
    pace_s: float = 0.25
    """Pause between two calls of one client."""


class Recorder:
    def __init__(self, path: Path) -> None:
        self.f = path.open("a")
        self.lock = threading.Lock()
        self.count = 0

    def write(self, kind: str, row: object) -> None:
        d = asdict(row)  # type: ignore[call-overload]
        d = {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in d.items()}
        with self.lock:
            self.f.write(json.dumps({"type": kind, **d}) + "\n")
            self.f.flush()
            self.count += 1


class Names:
    """The shared pool of workload names (a deleted name is retired, never reused)."""

    def __init__(self, rng: random.Random, prefix: str) -> None:
        self.rng, self.prefix, self.next, self.lock = rng, prefix, 0, threading.Lock()
        self.active: list[str] = []
        for _ in range(3):
            self.add()

    def add(self) -> None:
        self.active.append(f"{self.prefix}-{self.next}")
        self.next += 1

    def pick(self) -> str:
        with self.lock:
            return self.rng.choice(self.active)

    def retire(self, name: str) -> None:
        with self.lock:
            if name in self.active and self.rng.random() < 0.5:
                self.active.remove(name)
                self.add()


def api_client(n: int, s: LoadSettings, names: Names, rec: Recorder, stop: threading.Event) -> None:
    rng = random.Random(s.seed * 1000 + n)
    p = paths_for(s.cert_dir, "operator", "admin")
    creds = channel_credentials(load_tls(p))
    stubs = [workload_pb2_grpc.WorkloadServiceStub(grpc.secure_channel(e, creds)) for e in s.endpoints]
    while not stop.is_set() and rec.count < s.max_calls:
        name = names.pick()
        kind = rng.choices(["submit", "scale", "get", "delete"], [3, 2, 4, 1])[0]
        # a submitted spec always runs >= 1 instance (replicas 0 means the default, 1), so submits
        # ask for 1 and scales for 0 or 1: few engines on a small machine, yet every value is seen
        arg = 1 if kind == "submit" else rng.choice([0, 0, 1]) if kind == "scale" else None
        stub = rng.choice(stubs)
        start = time.time() - s.t0
        read: str | None = None
        try:
            if kind == "submit":
                spec = workload_pb2.WorkloadSpec(name=name, model="chaos", replicas=1)
                stub.SubmitWorkload(workload_pb2.SubmitWorkloadRequest(spec=spec), timeout=s.call_timeout_s)
            elif kind == "scale":
                stub.ScaleWorkload(
                    workload_pb2.ScaleWorkloadRequest(name=name, replicas=arg or 0), timeout=s.call_timeout_s
                )
            elif kind == "delete":
                stub.DeleteWorkload(workload_pb2.DeleteWorkloadRequest(name=name), timeout=s.call_timeout_s)
            else:
                w = stub.GetWorkload(workload_pb2.GetWorkloadRequest(name=name), timeout=s.call_timeout_s)
                read = "deleting" if w.workload.deleting else f"r={w.workload.spec.replicas}"
            result, code, end = OK, "", time.time() - s.t0
        except grpc.RpcError as e:
            code = e.code().name if e.code() is not None else "UNKNOWN"
            end = time.time() - s.t0
            if kind == "get" and code == "NOT_FOUND":
                result, code, read = OK, "", ""
            elif code in DEFINITE:
                result = FAILED
            else:
                result, end = UNKNOWN, math.inf
        rec.write("api", ApiOp(n, kind, name, arg, start, end, result, code, read))
        if kind == "delete" and result == OK:
            names.retire(name)
        stop.wait(s.pace_s * (0.5 + rng.random()))


def _outcome(e: grpc.RpcError) -> tuple[str, str]:
    code = e.code().name if e.code() is not None else "UNKNOWN"
    return (FAILED, code) if code in DEFINITE else (UNKNOWN, code)


def rollout_client(s: LoadSettings, rec: Recorder, stop: threading.Event) -> None:
    """Rollouts of workload chaos-roll (not served by the traffic): create a canary of a new model
    version, then promote it to completion or abort it; every call recorded like the API clients'."""
    rng = random.Random(s.seed * 3000)
    creds = channel_credentials(load_tls(paths_for(s.cert_dir, "operator", "admin")))
    chans = [grpc.secure_channel(e, creds) for e in s.endpoints]
    version = 0

    def call(kind: str, fn: Any, req: object, arg: int | None = None) -> str:
        start = time.time() - s.t0
        try:
            fn(rng.choice(chans))(req, timeout=s.call_timeout_s)
            result, code, end = OK, "", time.time() - s.t0
        except grpc.RpcError as e:
            (result, code), end = _outcome(e), time.time() - s.t0
            if result == UNKNOWN:
                end = math.inf
        rec.write("api", ApiOp(ROLL_CLIENT, kind, ROLL_WORKLOAD, arg, start, end, result, code))
        return result

    spec = workload_pb2.WorkloadSpec(name=ROLL_WORKLOAD, model=f"{ROLL_WORKLOAD}-v0", replicas=1)
    while not stop.is_set() and rec.count < s.max_calls:
        if (
            call(
                "submit",
                lambda c: workload_pb2_grpc.WorkloadServiceStub(c).SubmitWorkload,
                workload_pb2.SubmitWorkloadRequest(spec=spec),
                1,
            )
            == OK
        ):
            break
        stop.wait(1.0)

    def roll(c: grpc.Channel) -> Any:
        return rollout_pb2_grpc.RolloutServiceStub(c)

    target = rollout_pb2.RolloutRequest(workload=ROLL_WORKLOAD)
    while not stop.is_set() and rec.count < s.max_calls:
        version += 1
        create = rollout_pb2.CreateRolloutRequest(
            spec=rollout_pb2.RolloutSpec(
                workload=ROLL_WORKLOAD, model=f"{ROLL_WORKLOAD}-v{version}", canary_pct=50, min_requests=0
            )
        )
        call("rollout-create", lambda c: roll(c).CreateRollout, create)
        for _ in range(rng.randint(1, 3)):
            if stop.wait(2.0 + 2.0 * rng.random()):
                return
            call("rollout-get", lambda c: roll(c).GetRollout, target)
        if rng.random() < 0.6:
            call("rollout-promote", lambda c: roll(c).PromoteRollout, target)
            stop.wait(2.0)
            call("rollout-promote", lambda c: roll(c).PromoteRollout, target)
        else:
            call("rollout-abort", lambda c: roll(c).AbortRollout, target)
        stop.wait(4.0 + 2.0 * rng.random())


def one_request(gateway: str, stream: bool, timeout: float) -> str:
    """ "" on success, else what went wrong."""
    host, port = gateway.rsplit(":", 1)
    body = json.dumps(
        {
            "model": SERVE_WORKLOAD,
            "messages": [{"role": "user", "content": "chaos"}],
            "max_tokens": 4,
            "stream": stream,
        }
    )
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        if r.status != 200:
            return f"HTTP {r.status}"
        if stream and b"[DONE]" not in data:
            return "stream ended without [DONE]"
        return ""
    except (OSError, http.client.HTTPException) as e:
        return type(e).__name__ + (f": {e}" if str(e) else "")
    finally:
        conn.close()


def traffic_worker(n: int, s: LoadSettings, rec: Recorder, stop: threading.Event) -> None:
    rng = random.Random(s.seed * 7000 + n)
    i = n
    while not stop.is_set() and rec.count < s.max_requests:
        stream = rng.random() < 0.3
        start = time.time() - s.t0
        err, gw, attempts = "", "", 0
        for k in range(len(s.gateways)):
            gw = s.gateways[(i + k) % len(s.gateways)]
            attempts += 1
            err = one_request(gw, stream, s.request_timeout_s)
            if not err or (stream and attempts > 1):
                break
        i += 1
        rec.write("serve", ServeOp(start, time.time() - s.t0, stream, not err, gw, attempts, err))
        stop.wait(s.pace_s * (0.5 + rng.random()))


def run(s: LoadSettings) -> None:
    s.out.mkdir(parents=True, exist_ok=True)
    api_rec, serve_rec = Recorder(s.out / "api.jsonl"), Recorder(s.out / "serve.jsonl")
    stop = threading.Event()
    names = Names(random.Random(s.seed), f"chaos-{s.seed}")
    threads = [
        threading.Thread(target=api_client, args=(n, s, names, api_rec, stop), daemon=True)
        for n in range(s.api_clients)
    ] + [
        threading.Thread(target=traffic_worker, args=(n, s, serve_rec, stop), daemon=True)
        for n in range(s.traffic_workers)
    ]
    threads.append(threading.Thread(target=rollout_client, args=(s, api_rec, stop), daemon=True))
    for t in threads:
        t.start()
    end = time.monotonic() + s.max_duration_s
    while time.monotonic() < end and not s.stop_file.exists():
        time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join(timeout=s.call_timeout_s + s.request_timeout_s * len(s.gateways) + 5)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m chaos.clients")
    ap.add_argument("--endpoints", required=True)
    ap.add_argument("--gateways", required=True)
    ap.add_argument("--cert-dir", required=True)
    ap.add_argument("--t0", type=float, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stop-file", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-duration", type=float, default=900.0)
    a = ap.parse_args()
    run(
        LoadSettings(
            tuple(a.endpoints.split(",")),
            tuple(a.gateways.split(",")),
            Path(a.cert_dir),
            a.t0,
            Path(a.out),
            Path(a.stop_file),
            seed=a.seed,
            max_duration_s=a.max_duration,
        )
    )


if __name__ == "__main__":
    main()
