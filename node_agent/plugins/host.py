"""Run one vendor's device plugin as its own process (an out-of-process plugin).

    python -m node_agent.plugins.host --config device-plugin-config.yaml --device-type ascend \\
        --socket-dir DIR [--name N] [--state-dir D]

The process serves `DevicePlugin` (ListAndWatch, GetPreferredAllocation, Allocate) on the unix socket
`DIR/<name>.sock` (name defaults to `kunlun-<device type>`) with the in-process plugin's logic
(`VendorPlugin`), then registers with the agent's `PluginRegistration` service on
`DIR/kunlun-agent.sock`. It retries until the agent accepts, and registers again whenever the agent's
socket is re-created (the agent restarted). In simulated mode it uses the stand-in tools exactly like
the agent: the state directory (default: the parent of DIR, the agent's default layout) holds their
state file and shims. SIGTERM or SIGINT stops it; its socket is removed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NoReturn, TypeAlias

import grpc
import structlog

from kunlun_common.api import plugin_pb2, plugin_pb2_grpc
from kunlun_common.errors import ConfigError
from kunlun_common.logs import setup_logging
from kunlun_common.retry import backoff_delay
from kunlun_common.version import version
from node_agent.plugins.config import load_config
from node_agent.plugins.contract import PluginError
from node_agent.plugins.remote import AGENT_SOCKET, remove_stale_socket, unix_target
from node_agent.plugins.vendor_plugin import VendorPlugin
from node_agent.simulation import tool_env
from node_agent.vendors import ADAPTERS

log = structlog.get_logger("plugin-host")
VERSION = version()
Ctx: TypeAlias = grpc.aio.ServicerContext[Any, Any]


async def _abort(context: Ctx, message: str) -> NoReturn:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
    raise AssertionError("unreachable")  # context.abort raises


class DevicePluginService(plugin_pb2_grpc.DevicePluginServicer):
    """gRPC face of a VendorPlugin."""

    def __init__(self, plugin: VendorPlugin) -> None:
        self.plugin = plugin

    async def ListAndWatch(
        self, request: plugin_pb2.ListAndWatchRequest, context: Ctx
    ) -> AsyncIterator[plugin_pb2.PluginDeviceList]:
        log.info("agent watching", plugin=self.plugin.name, peer=context.peer())
        async for devices in self.plugin.list_and_watch():
            yield plugin_pb2.PluginDeviceList(devices=devices)

    async def GetPreferredAllocation(
        self, request: plugin_pb2.PreferredAllocationRequest, context: Ctx
    ) -> plugin_pb2.PreferredAllocationResponse:
        try:
            names = await self.plugin.preferred_allocation(
                request.available, request.must_include, request.size, request.require_p2p
            )
        except PluginError as e:
            await _abort(context, str(e))
        return plugin_pb2.PreferredAllocationResponse(
            devices=names, total_distance=self.plugin.total_distance(names)
        )

    async def Allocate(
        self, request: plugin_pb2.AllocateRequest, context: Ctx
    ) -> plugin_pb2.AllocateResponse:
        try:
            result = await self.plugin.allocate(request.devices)
        except PluginError as e:
            await _abort(context, str(e))
        return result.to_proto()


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


class PluginHost:
    """Serves one VendorPlugin on `<socket_dir>/<name>.sock` and keeps it registered with the agent."""

    def __init__(self, plugin: VendorPlugin, socket_dir: Path) -> None:
        self.plugin = plugin
        self.socket_dir = socket_dir
        self.socket_path = socket_dir / f"{plugin.name}.sock"
        self.agent_socket = socket_dir / AGENT_SOCKET
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        target = unix_target(self.socket_path)
        self.socket_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        remove_stale_socket(self.socket_path)
        server = grpc.aio.server()
        plugin_pb2_grpc.add_DevicePluginServicer_to_server(DevicePluginService(self.plugin), server)
        if not server.add_insecure_port(target):
            raise OSError(f"cannot listen on {self.socket_path}")
        await server.start()
        self._server = server
        log.info("plugin serving", plugin=self.plugin.name, socket=str(self.socket_path))

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0.5)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    async def register_once(self) -> plugin_pb2.PluginRegisterResponse:
        """One Register call; raises grpc.aio.AioRpcError when the agent does not answer."""
        request = plugin_pb2.PluginRegisterRequest(
            name=self.plugin.name,
            device_type=self.plugin.device_type,
            endpoint=str(self.socket_path.resolve()),
            version=VERSION,
        )
        async with grpc.aio.insecure_channel(unix_target(self.agent_socket)) as channel:
            stub = plugin_pb2_grpc.PluginRegistrationStub(channel)
            return await stub.Register(request, timeout=10.0)

    async def keep_registered(self, poll_s: float = 0.5) -> None:
        """Register (retrying with backoff), then again whenever the agent's socket is re-created."""
        registered: tuple[int, int] | None = None
        failures = 0
        while True:
            current = _identity(self.agent_socket)
            if current is not None and current != registered:
                try:
                    response = await self.register_once()
                except grpc.aio.AioRpcError as e:
                    failures += 1
                    log.warning(
                        "agent not answering; retrying", socket=str(self.agent_socket), error=e.code().name
                    )
                    await asyncio.sleep(backoff_delay(failures, 0.2, 3.0))
                    continue
                if response.accepted:
                    registered, failures = current, 0
                    log.info("registered with the agent", plugin=self.plugin.name, message=response.message)
                else:
                    failures += 1
                    log.error("agent refused the plugin", plugin=self.plugin.name, reason=response.message)
                    await asyncio.sleep(backoff_delay(failures, 1.0, 10.0))
                    continue
            await asyncio.sleep(poll_s)


def build_plugin(args: argparse.Namespace) -> tuple[VendorPlugin, Path]:
    """The plugin the arguments describe and its socket directory; raises ConfigError."""
    config = load_config(args.config)
    socket_dir = Path(args.socket_dir).resolve()
    state_dir = Path(args.state_dir) if args.state_dir else socket_dir.parent
    if not any(d.device_type == args.device_type for d in config.devices):
        raise ConfigError(f"{args.config}: no {args.device_type} device is declared; nothing to serve")
    env = tool_env(config, state_dir)
    plugin = VendorPlugin(config, args.device_type, env, name=args.name or f"kunlun-{args.device_type}")
    return plugin, socket_dir


async def serve(plugin: VendorPlugin, socket_dir: Path) -> None:
    """Serve `plugin` and keep it registered until SIGTERM/SIGINT."""
    host = PluginHost(plugin, socket_dir)
    await host.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    registrar = asyncio.create_task(host.keep_registered(), name="register")
    waiter = asyncio.create_task(stop.wait(), name="stop")
    try:
        await asyncio.wait([registrar, waiter], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (registrar, waiter):
            task.cancel()
        await asyncio.gather(registrar, waiter, return_exceptions=True)
        await host.stop()
        log.info("plugin stopped", plugin=plugin.name)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m node_agent.plugins.host", description="Run a Kunlun device plugin as its own process."
    )
    p.add_argument("--config", required=True, help="the node's device-plugin-config.yaml")
    p.add_argument("--device-type", required=True, choices=sorted(ADAPTERS), help="the vendor it serves")
    p.add_argument("--socket-dir", required=True, help="the agent's plugin socket directory")
    p.add_argument("--name", help="plugin name, unique on the node (default kunlun-<device type>)")
    p.add_argument(
        "--state-dir", help="simulated mode: the agent's state dir (default: parent of --socket-dir)"
    )
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging("kunlun-device-plugin", args.log_level)
    try:
        plugin, socket_dir = build_plugin(args)
        asyncio.run(serve(plugin, socket_dir))
    except (ConfigError, OSError, ValueError) as e:
        print(f"kunlun device plugin: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
