"""Out-of-process device plugins, agent side: the registration socket and the client of each plugin.

Like the Kubernetes kubelet, the agent serves `PluginRegistration` on a unix socket,
`<socket dir>/kunlun-agent.sock` (`node.plugin_socket_dir`, default `<state dir>/plugins`). A plugin
process (`python -m node_agent.plugins.host`) serves `DevicePlugin` on its own socket in that directory
and calls Register with its name, device type and socket path. The agent checks that the type is
declared on the node and that the socket answers, then opens ListAndWatch and from then on takes that
type's devices from the stream: an out-of-process plugin replaces the in-process one for its type.

When the stream breaks (the plugin process died or closed it), the plugin's devices turn Unavailable
with a reason naming the plugin, and stay so until a plugin registers again for the type; the agent
does not dial a dead plugin again by itself. A new registration for a type replaces the previous one.

The directory holds sockets that control devices: the agent creates it mode 0700, so only the agent's
user (and root) can register plugins.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import stat
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import grpc
import structlog

from kunlun_common.api import plugin_pb2, plugin_pb2_grpc, types_pb2
from kunlun_common.errors import TemporaryError
from kunlun_common.messages import Message, msg, of_error
from node_agent.plugins.config import NodeConfig
from node_agent.plugins.contract import AllocateResult, DevicePlugin, PluginError

log = structlog.get_logger("plugin-registry")

AGENT_SOCKET = "kunlun-agent.sock"
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes on Linux, with the terminating NUL
CALL_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 3.0
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
Ctx: TypeAlias = grpc.aio.ServicerContext[Any, Any]


def plugin_socket_dir(config: NodeConfig, state_dir: str | os.PathLike[str]) -> Path:
    """Where plugin sockets live: `node.plugin_socket_dir`, or `<state_dir>/plugins`."""
    return Path(config.plugin_socket_dir) if config.plugin_socket_dir else Path(state_dir) / "plugins"


def unix_target(path: str | os.PathLike[str]) -> str:
    """The gRPC address of a unix socket; raises ValueError when the path is too long for one."""
    text = os.path.abspath(os.fspath(path))
    if len(text.encode()) > MAX_SOCKET_PATH:
        raise ValueError(
            f"{text}: a unix socket path may have at most {MAX_SOCKET_PATH} bytes, this one has "
            f"{len(text.encode())}; choose a shorter node.plugin_socket_dir"
        )
    return f"unix:{text}"


def remove_stale_socket(path: Path) -> None:
    """Remove a socket file left by a process that died (binding fails while it exists)."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(path.lstat().st_mode):
            path.unlink()


class PluginGone(TemporaryError):
    """The plugin's socket does not answer or its stream broke."""


class RemotePlugin(DevicePlugin):
    """A plugin in another process, reached over its unix socket (gRPC `DevicePlugin`)."""

    def __init__(self, name: str, device_type: str, endpoint: str, version: str = "") -> None:
        self.name = name
        self.device_type = device_type
        self.endpoint = endpoint
        self.version = version
        self._channel = grpc.aio.insecure_channel(unix_target(endpoint))
        self._stub = plugin_pb2_grpc.DevicePluginStub(self._channel)

    def __repr__(self) -> str:
        return f"RemotePlugin({self.name!r}, {self.device_type!r}, {self.endpoint!r})"

    async def wait_ready(self, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        """Raise PluginGone unless the plugin's socket accepts a connection within `timeout_s`."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
        except TimeoutError:
            raise PluginGone(
                msg(
                    "plugin.no_answer",
                    "plugin {name}: nothing answers on {endpoint} within {timeout_s:g} s",
                    name=self.name,
                    endpoint=self.endpoint,
                    timeout_s=timeout_s,
                )
            ) from None

    async def list_and_watch(self) -> AsyncIterator[list[types_pb2.Device]]:
        try:
            async for reply in self._stub.ListAndWatch(plugin_pb2.ListAndWatchRequest()):
                yield list(reply.devices)
        except grpc.aio.AioRpcError as e:
            raise PluginGone(
                msg(
                    "plugin.stream_broke",
                    "its ListAndWatch stream broke ({code}: {details})",
                    code=e.code().name,
                    details=e.details() or "",
                )
            ) from None
        raise PluginGone(msg("plugin.stream_ended_by_plugin", "it ended its ListAndWatch stream"))

    async def preferred_allocation(
        self, available: Sequence[str], must_include: Sequence[str], size: int, require_p2p: bool
    ) -> list[str]:
        request = plugin_pb2.PreferredAllocationRequest(
            available=list(available), must_include=list(must_include), size=size, require_p2p=require_p2p
        )
        try:
            response = await self._stub.GetPreferredAllocation(request, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            raise self._error("GetPreferredAllocation", e) from None
        return list(response.devices)

    async def allocate(self, devices: Sequence[str]) -> AllocateResult:
        request = plugin_pb2.AllocateRequest(devices=list(devices))
        try:
            response = await self._stub.Allocate(request, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            raise self._error("Allocate", e) from None
        return AllocateResult.from_proto(response)

    def _error(self, method: str, e: grpc.aio.AioRpcError) -> Exception:
        if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
            return PluginError(e.details() or f"plugin {self.name} refused {method}")
        return PluginGone(
            msg(
                "plugin.call_failed",
                "plugin {name} ({endpoint}): {method} failed: {code}: {details}",
                name=self.name,
                endpoint=self.endpoint,
                method=method,
                code=e.code().name,
                details=e.details(),
            )
        )

    async def close(self) -> None:
        await self._channel.close(None)


DevicesCallback = Callable[[RemotePlugin, list[types_pb2.Device]], None]
GoneCallback = Callable[[RemotePlugin, Message], None]


class PluginRegistry(plugin_pb2_grpc.PluginRegistrationServicer):
    """Serves PluginRegistration on `<socket_dir>/kunlun-agent.sock` and watches every registered plugin.

    `on_devices(plugin, devices)` is called with each list a plugin sends; `on_gone(plugin, reason)`
    once when its stream breaks. `plugins` holds the live plugin of each device type.
    """

    def __init__(
        self,
        socket_dir: str | os.PathLike[str],
        device_types: Collection[str],
        on_devices: DevicesCallback,
        on_gone: GoneCallback,
    ) -> None:
        self.socket_dir = Path(socket_dir)
        self.socket_path = self.socket_dir / AGENT_SOCKET
        self.device_types = set(device_types)
        self.on_devices = on_devices
        self.on_gone = on_gone
        self.plugins: dict[str, RemotePlugin] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        """Listen on the registration socket; raises OSError/ValueError when it cannot."""
        target = unix_target(self.socket_path)
        self.socket_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        remove_stale_socket(self.socket_path)
        server = grpc.aio.server()
        plugin_pb2_grpc.add_PluginRegistrationServicer_to_server(self, server)
        try:
            port = server.add_insecure_port(target)
        except RuntimeError as e:
            raise OSError(f"cannot listen on {self.socket_path}: {e}") from None
        if not port:
            raise OSError(f"cannot listen on {self.socket_path}; check that the agent may write there")
        await server.start()
        self._server = server
        log.info("plugin registration listening", socket=str(self.socket_path))

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        for plugin in self.plugins.values():
            await plugin.close()
        self.plugins.clear()
        if self._server is not None:
            await self._server.stop(0.5)
            self._server = None
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()

    def _problem(self, request: plugin_pb2.PluginRegisterRequest) -> str | None:
        if not _NAME_RE.match(request.name):
            return f"plugin name {request.name!r} is not a name: letters, digits, '.', '_', '-' (1-63)"
        if request.device_type not in self.device_types:
            declared = ", ".join(sorted(self.device_types)) or "none"
            return (
                f"plugin {request.name}: device type {request.device_type!r} is not declared on this node "
                f"(declared: {declared})"
            )
        if not os.path.isabs(request.endpoint):
            return f"plugin {request.name}: endpoint {request.endpoint!r} must be an absolute socket path"
        try:
            unix_target(request.endpoint)
        except ValueError as e:
            return f"plugin {request.name}: {e}"
        for other in self.plugins.values():
            if other.name == request.name and other.device_type != request.device_type:
                return f"plugin name {request.name} is already used by the {other.device_type} plugin"
        return None

    async def Register(
        self, request: plugin_pb2.PluginRegisterRequest, context: Ctx
    ) -> plugin_pb2.PluginRegisterResponse:
        problem = self._problem(request)
        plugin: RemotePlugin | None = None
        if problem is None:
            plugin = RemotePlugin(request.name, request.device_type, request.endpoint, request.version)
            try:
                await plugin.wait_ready()
            except PluginGone as e:
                problem = str(e)
                await plugin.close()
        if problem is not None or plugin is None:
            log.warning("plugin registration refused", plugin=request.name, reason=problem)
            return plugin_pb2.PluginRegisterResponse(accepted=False, message=problem or "refused")
        await self._replace(plugin)
        log.info(
            "plugin registered",
            plugin=plugin.name,
            device_type=plugin.device_type,
            endpoint=plugin.endpoint,
            version=plugin.version,
        )
        return plugin_pb2.PluginRegisterResponse(
            accepted=True, message=f"{plugin.name} serves the {plugin.device_type} devices of this node"
        )

    async def _replace(self, plugin: RemotePlugin) -> None:
        old_task = self._tasks.pop(plugin.device_type, None)
        old = self.plugins.pop(plugin.device_type, None)
        if old_task is not None:
            old_task.cancel()
            await asyncio.gather(old_task, return_exceptions=True)
        if old is not None:
            await old.close()
        self.plugins[plugin.device_type] = plugin
        self._tasks[plugin.device_type] = asyncio.create_task(
            self._watch(plugin), name=f"plugin-watch-{plugin.name}"
        )

    async def _watch(self, plugin: RemotePlugin) -> None:
        try:
            async for devices in plugin.list_and_watch():
                self.on_devices(plugin, devices)
        except PluginGone as e:
            reason = of_error(e)
        except Exception as e:  # a bad message must not leave the devices looking alive
            log.exception("plugin stream failed", plugin=plugin.name)
            reason = msg(
                "plugin.stream_failed",
                "its stream failed ({kind}: {error})",
                kind=type(e).__name__,
                error=str(e),
            )
        else:  # list_and_watch never ends normally; keep the type checker and readers sure of it
            reason = msg("plugin.stream_ended", "its stream ended")
        message = msg(
            "plugin.gone",
            "plugin {name} ({endpoint}) is gone: {reason}; its devices come back when it registers again "
            "(restart it)",
            name=plugin.name,
            endpoint=plugin.endpoint,
            reason=reason,
        )
        log.warning("plugin gone", plugin=plugin.name, device_type=plugin.device_type, reason=str(reason))
        if self.plugins.get(plugin.device_type) is plugin:
            del self.plugins[plugin.device_type]
            self._tasks.pop(plugin.device_type, None)
            self.on_gone(plugin, message)
        await plugin.close()
