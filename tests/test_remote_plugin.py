"""Out-of-process device plugins: a real plugin host process on real unix sockets, stand-in tools as hardware."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import pytest

from kunlun_common.api import plugin_pb2, plugin_pb2_grpc, types_pb2
from node_agent.devices import DeviceManager, simulated_env
from node_agent.plugins.config import load_config
from node_agent.plugins.contract import AllocateResult, PluginError
from node_agent.plugins.remote import AGENT_SOCKET, plugin_socket_dir, unix_target
from node_agent.plugins.standin.state import update_chip
from tests.conftest import FAST_TMP

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "deploy" / "examples" / "node-a.yaml"
READY = types_pb2.DEVICE_STATUS_READY
UNHEALTHY = types_pb2.DEVICE_STATUS_UNHEALTHY
UNAVAILABLE = types_pb2.DEVICE_STATUS_UNAVAILABLE
A = [f"node-a/ascend:{i}" for i in range(4)]
DEADLINE = 20.0  # a plugin process starting (python, grpc) on a loaded machine


async def until(what: str, cond: Callable[[], bool], within: float = DEADLINE) -> None:
    """Poll `cond` until it holds; fail naming `what` after `within` seconds."""
    deadline = time.monotonic() + within
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within} s: {what}")
        await asyncio.sleep(0.05)


@pytest.fixture
def state_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="krp-", dir=FAST_TMP))  # short: unix socket paths are limited
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def manager(state_dir: Path) -> AsyncIterator[DeviceManager]:
    config = load_config(CONFIG)
    m = DeviceManager(config, simulated_env(config, state_dir))
    await m.sample()
    await m.start(plugin_socket_dir(config, state_dir))
    yield m
    await m.stop()


class Host:
    """`python -m node_agent.plugins.host` for node-a's Ascend cards, restartable."""

    def __init__(self, socket_dir: Path, log: Path) -> None:
        self.socket_dir = socket_dir
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = [
            sys.executable,
            "-m",
            "node_agent.plugins.host",
            "--config",
            str(CONFIG),
            "--device-type",
            "ascend",
        ]
        argv += ["--socket-dir", str(self.socket_dir)]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            self.proc.wait(10)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def host(state_dir: Path) -> Iterator[Host]:
    h = Host(state_dir / "plugins", state_dir / "plugin.log")
    yield h
    h.kill()


def served_by(m: DeviceManager, plugin: str, status: int) -> Callable[[], bool]:
    return lambda: all(d.plugin == plugin and d.status == status for d in m.devices())


async def test_plugin_process_registers_serves_dies_and_comes_back(
    manager: DeviceManager, host: Host, state_dir: Path
) -> None:
    assert [d.plugin for d in manager.devices()] == ["ascend"] * 4  # in-process until one registers
    host.start()
    await until(
        "the plugin process registers and its devices are Ready", served_by(manager, "kunlun-ascend", READY)
    )
    assert manager.tool_errors == {}

    remote = manager.plugin("ascend")
    assert remote is not None and remote.name == "kunlun-ascend"
    assert await remote.preferred_allocation(A, [], 2, True) == A[:2]
    assert await remote.preferred_allocation(A, [A[3]], 2, False) == A[2:]
    assert await remote.allocate([A[2], A[3]]) == AllocateResult(
        envs={"ASCEND_RT_VISIBLE_DEVICES": "2,3"},
        device_nodes=(
            "/dev/davinci2",
            "/dev/davinci3",
            "/dev/davinci_manager",
            "/dev/devmm_svm",
            "/dev/hisi_hdc",
        ),
        engine_args=("--device", "npu", "--attention-backend", "ascend"),
    )
    with pytest.raises(PluginError, match="node-b/ascend:0 is a device of node node-b"):
        await remote.allocate(["node-b/ascend:0"])

    # The stream carries status changes: the in-process plugin is not sampled any more.
    update_chip(state_dir / "sim-state.json", "ascend", 1, health="Critical")
    await manager.sample()
    await until(
        "ascend:1 turns Unhealthy through ListAndWatch", lambda: manager.devices()[1].status == UNHEALTHY
    )
    update_chip(state_dir / "sim-state.json", "ascend", 1, health="OK")
    await until("ascend:1 turns Ready again", lambda: manager.devices()[1].status == READY)

    host.kill(signal.SIGKILL)
    await until("the devices turn Unavailable", served_by(manager, "kunlun-ascend", UNAVAILABLE), 10)
    reason = manager.devices()[0].status_reason
    assert reason.startswith("plugin kunlun-ascend (") and "is gone" in reason
    assert "ascend" in manager.tool_errors
    assert manager.plugin("ascend") is None
    await manager.sample()  # the in-process plugin does not take over again
    assert all(d.status == UNAVAILABLE for d in manager.devices())

    host.start()
    await until("the restarted plugin registers again", served_by(manager, "kunlun-ascend", READY))
    assert manager.tool_errors == {}
    assert "registered with the agent" in host.output()


async def test_registration_is_checked(manager: DeviceManager, state_dir: Path) -> None:
    target = unix_target(state_dir / "plugins" / AGENT_SOCKET)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = plugin_pb2_grpc.PluginRegistrationStub(channel)

        async def register(name: str, device_type: str, endpoint: str) -> plugin_pb2.PluginRegisterResponse:
            request = plugin_pb2.PluginRegisterRequest(name=name, device_type=device_type, endpoint=endpoint)
            return await stub.Register(request, timeout=10)

        r = await register("gpu", "nvidia", str(state_dir / "plugins" / "gpu.sock"))
        assert (
            not r.accepted
            and "device type 'nvidia' is not declared on this node (declared: ascend)" in r.message
        )
        r = await register("npu", "ascend", str(state_dir / "plugins" / "nobody.sock"))
        assert not r.accepted and "nothing answers on" in r.message and "nobody.sock" in r.message
        r = await register("bad name!", "ascend", "/x.sock")
        assert not r.accepted and "is not a name" in r.message
        r = await register("npu", "ascend", "relative.sock")
        assert not r.accepted and "must be an absolute socket path" in r.message
    assert [d.plugin for d in manager.devices()] == ["ascend"] * 4


async def test_host_refuses_an_undeclared_type(state_dir: Path) -> None:
    argv = [
        sys.executable,
        "-m",
        "node_agent.plugins.host",
        "--config",
        str(CONFIG),
        "--device-type",
        "nvidia",
    ]
    proc = await asyncio.create_subprocess_exec(
        *argv, "--socket-dir", str(state_dir / "plugins"), cwd=ROOT, stderr=asyncio.subprocess.PIPE
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert "no nvidia device is declared; nothing to serve" in err.decode()


def test_socket_paths_that_are_too_long_are_refused() -> None:
    with pytest.raises(ValueError, match="a unix socket path may have at most 107 bytes"):
        unix_target("/tmp/" + "x" * 120 + "/kunlun-agent.sock")
