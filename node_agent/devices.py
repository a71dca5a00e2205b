"""The agent's view of its devices: it runs the device plugins and merges what they report.

Every declared device is listed, in declaration order, and never dropped: a device that cannot be
used is reported with a status (Error, Unhealthy, Unavailable) and the reason. The devices of each
vendor come from one plugin (`node_agent.plugins.contract`):

- by default the in-process `VendorPlugin` of that vendor, sampled by `sample()` (the agent calls it
  every `health_interval_seconds`): it runs the vendor tool and cross-checks the declarations;
- once an out-of-process plugin registers for the vendor on the plugin socket (`start()`; see
  `node_agent.plugins.remote`), its ListAndWatch stream instead. The in-process plugin of that vendor is
  no longer sampled. When the plugin process dies its devices turn Unavailable, naming the plugin,
  until it registers again.

The declaration stays the source of every device's attributes; a plugin contributes status, reason
and telemetry. Declarations of an unknown device type are in Error from the start.

In simulated mode the same adapters run against stand-in tools (installed as shims on a private PATH)
that read a per-node state file seeded from the declaration (`simulated_env`, loaded through
`node_agent.simulation`, which injects the simulator); nothing else differs.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from pathlib import Path

import structlog

from kunlun_common.api import agent_pb2, types_pb2
from kunlun_common.messages import Message, msg
from node_agent.plugins.config import NodeConfig
from node_agent.plugins.contract import DevicePlugin
from node_agent.plugins.remote import PluginRegistry, RemotePlugin
from node_agent.plugins.vendor_plugin import (
    ToolSample,
    VendorPlugin,
    device_from_decl,
    joined,
    plugins_for,
    set_reason,
)
from node_agent.simulation import simulated_mode

log = structlog.get_logger("devices")
ERROR = types_pb2.DEVICE_STATUS_ERROR
UNAVAILABLE = types_pb2.DEVICE_STATUS_UNAVAILABLE


def simulated_env(config: NodeConfig, state_dir: Path) -> dict[str, str]:
    """Seed the stand-in tools' state from the declaration (once) and put their shims on PATH."""
    return simulated_mode(config, state_dir).env


class DeviceManager:
    """Runs the node's device plugins and keeps one Device per declaration (see the module docstring)."""

    def __init__(self, config: NodeConfig, env: Mapping[str, str]) -> None:
        self.config = config
        self.env = env
        self.plugins: dict[str, VendorPlugin] = plugins_for(config, env)
        self.remote_types: set[str] = set()  # types served out of process (now or before it died)
        self.registry: PluginRegistry | None = None
        self.tool_errors: dict[str, str] = {}
        """Why a vendor's tool (or its out-of-process plugin) cannot be used now, by device type."""
        self.tool_error_messages: dict[str, Message] = {}
        """The same as messages (for the reader's language)."""
        self._devices: dict[str, types_pb2.Device] = {}
        for d in config.devices:
            dev = device_from_decl(config, d, d.device_type)
            if d.device_type not in self.plugins:
                dev.status = ERROR
                no_plugin = msg("device.no_plugin", "no plugin for {device_type}", device_type=d.device_type)
                set_reason(dev, joined([p.message() for p in d.errors]) or no_plugin)
            self._devices[dev.name] = dev

    # ------------------------------------------------------------------------------------ sampling

    def _active(self) -> list[VendorPlugin]:
        return [p for t, p in self.plugins.items() if t not in self.remote_types]

    async def sample(self) -> None:
        """Sample every in-process plugin (vendor tools run in threads) and update their devices."""
        active = self._active()
        await asyncio.gather(*(p.refresh() for p in active))
        for plugin in active:
            if plugin.device_type not in self.remote_types:  # one may have taken over meanwhile
                self._absorb(plugin)

    def sample_blocking(self) -> dict[str, ToolSample]:
        """Sample every in-process plugin once in this thread (for `kunlun-device-probe`, which runs no
        event loop); returns each vendor's tool run."""
        runs: dict[str, ToolSample] = {}
        for plugin in self._active():
            runs[plugin.device_type] = sample = plugin.poll()
            plugin.apply(sample)
            self._absorb(plugin)
        return runs

    def _absorb(self, plugin: VendorPlugin) -> None:
        self._tool_error(plugin.device_type, plugin.tool_error_message)
        self._merge(plugin.device_type, plugin.name, plugin.devices())

    def _tool_error(self, device_type: str, error: Message | None) -> None:
        if error is None:
            self.tool_errors.pop(device_type, None)
            self.tool_error_messages.pop(device_type, None)
        else:
            self.tool_errors[device_type] = str(error)
            self.tool_error_messages[device_type] = error

    def _merge(self, device_type: str, plugin: str, reported: list[types_pb2.Device]) -> None:
        by_name = {d.name: d for d in reported}
        for name, dev in self._devices.items():
            if dev.device_type != device_type:
                continue
            got = by_name.pop(name, None)
            dev.plugin = plugin
            if got is None:
                dev.status = ERROR
                set_reason(
                    dev,
                    msg(
                        "device.not_reported",
                        "plugin {plugin} does not report {name}, declared in {path}",
                        plugin=plugin,
                        name=name,
                        path=self.config.path,
                    ),
                )
                dev.ClearField("telemetry")
                continue
            dev.status, dev.status_reason = got.status, got.status_reason
            dev.status_reason_message = got.status_reason_message  # the plugin's message, if it sent one
            dev.telemetry.CopyFrom(got.telemetry)
        if by_name:
            log.warning("plugin reports undeclared devices; ignored", plugin=plugin, devices=sorted(by_name))

    # ------------------------------------------------------------------------------------ reading

    def devices(self) -> list[types_pb2.Device]:
        return list(self._devices.values())

    def samples(self) -> list[agent_pb2.DeviceSample]:
        return [
            agent_pb2.DeviceSample(
                name=dev.name,
                telemetry=dev.telemetry,
                status=dev.status,
                status_reason=dev.status_reason,
                status_reason_message=dev.status_reason_message,
            )
            for dev in self._devices.values()
        ]

    def plugin(self, device_type: str) -> DevicePlugin | None:
        """The plugin serving `device_type` now: the registered out-of-process one, else the in-process
        one (None when the type's out-of-process plugin is gone, or none is declared)."""
        if self.registry is not None and device_type in self.registry.plugins:
            return self.registry.plugins[device_type]
        return None if device_type in self.remote_types else self.plugins.get(device_type)

    # ------------------------------------------------------------------------------------ out of process

    async def start(self, socket_dir: str | os.PathLike[str]) -> None:
        """Accept out-of-process plugins on `<socket_dir>/kunlun-agent.sock`. When the socket cannot be
        created the agent runs with its in-process plugins only (and says why in its log)."""
        registry = PluginRegistry(socket_dir, self.plugins, self._on_remote_devices, self._on_remote_gone)
        try:
            await registry.start()
        except (OSError, ValueError) as e:
            await registry.stop()
            log.warning("out-of-process device plugins disabled", reason=str(e))
            return
        self.registry = registry

    async def stop(self) -> None:
        if self.registry is not None:
            await self.registry.stop()
            self.registry = None

    def _on_remote_devices(self, plugin: RemotePlugin, devices: list[types_pb2.Device]) -> None:
        if plugin.device_type not in self.remote_types:
            log.info(
                "out-of-process plugin replaces the in-process one",
                plugin=plugin.name,
                type=plugin.device_type,
            )
        self.remote_types.add(plugin.device_type)
        self._tool_error(plugin.device_type, None)
        self._merge(plugin.device_type, plugin.name, devices)

    def _on_remote_gone(self, plugin: RemotePlugin, reason: Message) -> None:
        self.remote_types.add(plugin.device_type)
        self._tool_error(plugin.device_type, reason)
        for dev in self._devices.values():
            if dev.device_type == plugin.device_type:
                dev.status = UNAVAILABLE
                set_reason(dev, reason)
                dev.ClearField("telemetry")
