"""Support for the gateway tests (no tests in here): processes, a fake control plane, entry points.

- `Engine` / `GatewayProc`: kunlun-test-engine and kunlun-gateway as real processes on loopback.
- `FakeControlPlane`: replicas in a thread of their own (own event loop) that serve only what a
  gateway calls (WatchEndpoints, WatchGatewayConfig, Heartbeat) from memory, over mTLS, so tests
  can change the snapshot at will and kill/revive a replica.
- `python -m tests.test_gateway_support replica ARGS...`: a real replica that also serves
  GatewayService (what controlplane/replica.py does once it registers the servicer).
- `python -m tests.test_gateway_support cli ARGS...`: kunlun-cli including the `gateway` commands.
- `python -m tests.test_gateway_support agent NODE ENDPOINTS CERT_DIR`: a simulated agent that
  registers 4 devices and heartbeats but never runs anything (tests write instance status).
"""

from __future__ import annotations

import asyncio
import inspect
import ssl
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import grpc

from devcluster.procs import ManagedProcess, free_port
from gateway.httpclient import HttpConnection, HttpError, Response
from kunlun_common.api import (
    agent_pb2,
    agent_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    types_pb2,
    workload_pb2,
    workload_pb2_grpc,
)
from kunlun_common.pki import paths_for
from kunlun_common.tls import channel_credentials, load_tls, peer_identity, server_credentials

T = TypeVar("T")
PY = sys.executable
_EOF = grpc.aio.EOF  # type: ignore[attr-defined]


async def until(pred: Callable[[], Any], within_s: float, what: str, interval: float = 0.02) -> Any:
    """Poll `pred` (sync or async) until it returns something truthy; TimeoutError naming `what`."""
    end = time.monotonic() + within_s
    last: Exception | None = None
    while True:
        try:
            value = pred()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value
        except (HttpError, OSError, KeyError, ValueError, AssertionError) as e:
            last = e
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {within_s}s waiting for {what} (last error: {last})")
        await asyncio.sleep(interval)


# ------------------------------------------------------------------------------ processes
class Engine:
    """A kunlun-test-engine process; its served model name is its instance id."""

    def __init__(self, base: Path, name: str, *flags: str) -> None:
        self.name = name
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        argv = [
            PY,
            "-m",
            "node_agent.testengine",
            "--port",
            str(self.port),
            "--served-model-name",
            name,
            *flags,
        ]
        self.proc = ManagedProcess(f"engine-{name}", argv, base / f"engine-{name}.log")
        self.proc.start()

    async def ready(self, within_s: float = 20.0, tcp_only: bool = False) -> None:
        async def up() -> bool:
            if tcp_only:
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.close()
                await writer.wait_closed()
                return True
            conn = HttpConnection("127.0.0.1", self.port)
            try:
                return (await conn.request("GET", "/health", timeout_s=1.0)).status == 200
            finally:
                await conn.close()

        await until(up, within_s, f"engine {self.name} to answer /health", 0.05)

    def endpoint(self, workload: str) -> workload_pb2.Endpoint:
        return workload_pb2.Endpoint(instance_id=self.name, address=self.address, workload=workload, node="n")

    def stop(self) -> None:
        self.proc.resume()
        self.proc.stop(5)


async def start_engines(base: Path, names: list[str], *flags: str, tcp_only: bool = False) -> list[Engine]:
    engines = [Engine(base, n, *flags) for n in names]
    try:
        await asyncio.gather(*(e.ready(tcp_only=tcp_only) for e in engines))
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return engines


class GatewayProc:
    """A kunlun-gateway process on a free port."""

    def __init__(
        self, base: Path, name: str, *args: str, key: str = "", tls: ssl.SSLContext | None = None
    ) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.key = key
        self.tls = tls
        argv = [PY, "-m", "gateway.main", f"--listen={self.address}", *args]
        self.proc = ManagedProcess(name, argv, base / f"{name}.log")
        self.proc.start()

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"} if self.key else {}

    def connect(self) -> HttpConnection:
        return HttpConnection("127.0.0.1", self.port, self.tls)

    async def status(self) -> dict[str, Any]:
        conn = self.connect()
        try:
            r = await conn.request("GET", "/kunlun/status", headers=self.headers(), timeout_s=2.0)
            assert r.status == 200, r.body
            data: dict[str, Any] = r.json()
            return data
        finally:
            await conn.close()

    async def ready(self, within_s: float = 20.0) -> dict[str, Any]:
        async def synced() -> dict[str, Any] | None:
            if not self.proc.alive():
                raise RuntimeError(f"gateway exited: {self.proc.log_text()[-2000:]}")
            st = await self.status()
            return st if st["synced"] else None

        result: dict[str, Any] = await until(synced, within_s, "the gateway to serve a snapshot", 0.05)
        return result

    def stop(self) -> None:
        self.proc.stop(5)


async def post(
    conn: HttpConnection, path: str, body: bytes, headers: dict[str, str] | None = None
) -> Response:
    return await conn.request(
        "POST", path, body, {"content-type": "application/json", **(headers or {})}, timeout_s=10.0
    )


# ------------------------------------------------------------------------------ fake control plane
def _role(context: Any) -> str:
    ident = peer_identity(context.auth_context())
    return ident.role if ident is not None else ""


class FakeControlPlane:
    """Replicas (own thread and loop) serving a gateway's feed from memory, with mTLS."""

    def __init__(self, cert_dir: Path, replicas: int = 2) -> None:
        self.material = [
            load_tls(paths_for(cert_dir, "replica", f"replica-{i + 1}")) for i in range(replicas)
        ]
        self.addresses = [f"127.0.0.1:{free_port()}" for _ in range(replicas)]
        self.servers: list[grpc.aio.Server | None] = [None] * replicas
        self.endpoints: list[workload_pb2.Endpoint] = []
        self.config = gateway_pb2.GatewayConfig()
        self.version = 0
        self.heartbeats = [0] * replicas
        self.registered: dict[str, gateway_pb2.GatewayInfo] = {}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fake-control-plane", daemon=True)
        self._cond: asyncio.Condition | None = None

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(15)

    def start(self) -> None:
        self.thread.start()
        self._run(self._setup())
        for i in range(len(self.servers)):
            self.revive(i)

    async def _setup(self) -> None:
        self._cond = asyncio.Condition()

    async def _serve(self, i: int) -> None:
        server = grpc.aio.server()
        workload_pb2_grpc.add_WorkloadServiceServicer_to_server(_FakeWorkloads(self), server)  # type: ignore[abstract]
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(_FakeGateways(self, i), server)  # type: ignore[abstract]
        server.add_secure_port(self.addresses[i], server_credentials(self.material[i]))
        await server.start()
        self.servers[i] = server

    async def _stop(self, i: int) -> None:
        server, self.servers[i] = self.servers[i], None
        if server is not None:
            await server.stop(0)

    def revive(self, i: int) -> None:
        self._run(self._serve(i))

    def kill(self, i: int) -> None:
        self._run(self._stop(i))

    def close(self) -> None:
        for i in range(len(self.servers)):
            self.kill(i)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    def publish(
        self,
        endpoints: list[workload_pb2.Endpoint] | None = None,
        config: gateway_pb2.GatewayConfig | None = None,
    ) -> int:
        """Replace the snapshot and/or the config; every open stream gets it at once."""
        return self._run(self._publish(endpoints, config))

    async def _publish(
        self, endpoints: list[workload_pb2.Endpoint] | None, config: gateway_pb2.GatewayConfig | None
    ) -> int:
        assert self._cond is not None
        async with self._cond:
            if endpoints is not None:
                self.endpoints = list(endpoints)
            if config is not None:
                self.config = config
            self.version += 1
            self._cond.notify_all()
        return self.version

    async def changes(self) -> AsyncIterator[int]:
        assert self._cond is not None
        cond = self._cond
        seen = -1
        while True:
            async with cond:
                while self.version == seen:
                    await cond.wait()
                seen = self.version
            yield seen


class _FakeWorkloads(workload_pb2_grpc.WorkloadServiceServicer):
    def __init__(self, cp: FakeControlPlane) -> None:
        self.cp = cp

    async def WatchEndpoints(
        self, request: workload_pb2.WatchEndpointsRequest, context: Any
    ) -> AsyncIterator[workload_pb2.EndpointsSnapshot]:
        if _role(context) != "gateway":
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "gateways only")
        async for version in self.cp.changes():
            yield workload_pb2.EndpointsSnapshot(endpoints=self.cp.endpoints, revision=version)


class _FakeGateways(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, cp: FakeControlPlane, index: int) -> None:
        self.cp = cp
        self.index = index

    async def WatchGatewayConfig(
        self, request: gateway_pb2.WatchGatewayConfigRequest, context: Any
    ) -> AsyncIterator[gateway_pb2.GatewayConfig]:
        async for version in self.cp.changes():
            cfg = gateway_pb2.GatewayConfig()
            cfg.CopyFrom(self.cp.config)
            cfg.revision = version
            yield cfg

    async def Heartbeat(
        self, request: gateway_pb2.GatewayHeartbeatRequest, context: Any
    ) -> gateway_pb2.GatewayHeartbeatResponse:
        self.cp.heartbeats[self.index] += 1
        self.cp.registered[request.info.name] = request.info
        return gateway_pb2.GatewayHeartbeatResponse(
            lease=request.lease or 100 + self.index, ttl_s=request.ttl_s, replica=f"replica-{self.index + 1}"
        )


# ------------------------------------------------------------------------------ entry points
def run_replica(argv: list[str]) -> None:
    """A replica (it serves GatewayService itself)."""
    from controlplane import main as replica_main

    replica_main.main(argv)


def run_cli(argv: list[str]) -> None:
    """kunlun-cli with the `gateway` commands (until cli/main.py registers them itself)."""
    import argparse

    from controlplane.cli import gateway_cmd
    from controlplane.cli import main as cli_main

    real = cli_main.build_parser

    def build() -> argparse.ArgumentParser:
        p = real()
        sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        if "gateway" not in sub.choices:
            gateway_cmd.register(sub, cli_main._common(suppress=True))
        return p

    cli_main.build_parser = build
    cli_main.main(argv)


def _sim_devices(node: str) -> list[types_pb2.Device]:
    return [
        types_pb2.Device(
            name=f"{node}/ascend:{i}",
            node=node,
            device_type="ascend",
            index=i,
            model="910B",
            total_memory_mb=32768,
            hbm_memory_mb=32768,
            supported_dtypes=["fp16", "bf16"],
            status=types_pb2.DEVICE_STATUS_READY,
        )
        for i in range(4)
    ]


async def _sim_session(ep: str, node: str, creds: grpc.ChannelCredentials) -> None:
    async with grpc.aio.secure_channel(
        ep, creds, options=[("grpc.ssl_target_name_override", "localhost")]
    ) as ch:
        call = agent_pb2_grpc.AgentServiceStub(ch).Connect()  # type: ignore[call-arg]
        reg = agent_pb2.RegisterNode(
            node=node, address="127.0.0.1", simulated=True, devices=_sim_devices(node)
        )
        await asyncio.wait_for(call.write(agent_pb2.AgentMessage(register=reg)), 5)
        if await asyncio.wait_for(call.read(), 5) is _EOF:
            return
        last_ack = time.monotonic()

        async def read() -> None:
            nonlocal last_ack
            while (msg := await call.read()) is not _EOF:
                if isinstance(msg, agent_pb2.ReplicaMessage) and msg.WhichOneof("kind") == "heartbeat_ack":
                    last_ack = time.monotonic()

        reader = asyncio.create_task(read())
        seq = 0
        try:
            while not reader.done() and time.monotonic() - last_ack < 3.0:
                seq += 1
                samples = [
                    agent_pb2.DeviceSample(
                        name=d.name,
                        status=types_pb2.DEVICE_STATUS_READY,
                        telemetry=types_pb2.DeviceTelemetry(temperature_c=40.0, memory_used_mb=0),
                    )
                    for d in _sim_devices(node)
                ]
                hb = agent_pb2.Heartbeat(seq=seq, sent_at_unix_ms=int(time.time() * 1000), samples=samples)
                await asyncio.wait_for(call.write(agent_pb2.AgentMessage(heartbeat=hb)), 3)
                await asyncio.sleep(1.0)
        finally:
            reader.cancel()
            call.cancel()


async def run_sim_agent(node: str, endpoints: list[str], cert_dir: str) -> None:
    creds = channel_credentials(load_tls(paths_for(cert_dir, "agent", node)))
    i = 0
    while True:
        try:
            await _sim_session(endpoints[i % len(endpoints)], node, creds)
        except (grpc.aio.AioRpcError, OSError, TimeoutError) as e:
            print(f"sim agent: {endpoints[i % len(endpoints)]}: {e}", flush=True)
        i += 1
        await asyncio.sleep(0.2)


def main(argv: list[str]) -> None:
    cmd, rest = argv[0], argv[1:]
    if cmd == "replica":
        run_replica(rest)
    elif cmd == "cli":
        run_cli(rest)
    elif cmd == "agent":
        asyncio.run(run_sim_agent(rest[0], rest[1].split(","), rest[2]))
    else:
        raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
