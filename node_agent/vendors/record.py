"""The one record each vendor module exports (`VENDOR`), and what it is made of.

A vendor is everything the node agent knows about one accelerator family, in one place:

- `type_name` and `aliases`: the device type written in configs and device names (`node-a/ascend:0`)
  and the words people write instead (`npu`, `dcu`...), used for "did you mean" hints;
- `adapter`: the class that runs the vendor's tool and parses what it prints (`node_agent.vendors.base`);
- `runtime`: how an engine process gets a set of devices (`VendorRuntime`);
- `standin`: the simulator's stand-in for the tool (a module of `node_agent.plugins.standin`, named here
  by string so that production code never imports the simulator).

Facts every process needs (the control plane validates workloads with them) live in the shared registry
line of `kunlun_common.names.VENDOR_NAMES`; the record reads them from there (`sglang_refusal`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kunlun_common.names import sglang_refusal
from node_agent.vendors.base import VendorAdapter

DEFAULT_CACHE_KEY = ("model", "engine_version", "device_model")


@dataclass(frozen=True)
class VendorRuntime:
    """What one vendor's runtime needs to see a set of devices and to compile into a cache."""

    visible_env: str
    """Variable that restricts the runtime to the allocated devices ("0,1": ascending logical ids)."""
    device_node: Callable[[int], str]
    """The device node of one device, from its node id (`ObservedDevice.node_id`; the index by default)."""
    shared_nodes: tuple[str, ...]
    """The vendor's shared control nodes, exposed with every allocation."""
    sglang_args: tuple[str, ...] = ()
    """Arguments SGLang needs on this hardware (checked against SGLang's own argument list in CI)."""
    cache_env: tuple[tuple[str, str], ...] = ()
    """Vendor compiler caches: (variable, subdirectory of the instance's compile cache directory)."""
    cache_key: tuple[str, ...] = DEFAULT_CACHE_KEY
    """Fields of the launch request that name the compile cache directory (see launch_plan.cache_key)."""

    def device_nodes(self, node_ids: Mapping[int, int], indexes: list[int]) -> tuple[str, ...]:
        """The per-device nodes of `indexes` (ascending) and then the shared nodes."""
        return (*(self.device_node(node_ids.get(i, i)) for i in indexes), *self.shared_nodes)


@dataclass(frozen=True)
class StandIn:
    """The simulator's stand-in for the vendor tool(s)."""

    module: str
    """Module of `node_agent.plugins.standin` whose `TOOLS` maps each tool name to its main function."""
    tools: tuple[str, ...]
    """The tool names the stand-in answers to (shims of these names are put on PATH)."""


@dataclass(frozen=True)
class Vendor:
    """Everything about one accelerator vendor (see the module docstring)."""

    type_name: str
    """Device type, e.g. "ascend"; the module's name and its line in kunlun_common.names.VENDOR_NAMES."""
    aliases: tuple[str, ...]
    """Words written instead of the type name ("npu"), suggested as "did you mean 'ascend'?"."""
    adapter: type[VendorAdapter]
    """The tool adapter: command lines and parser."""
    runtime: VendorRuntime
    """Visibility variable, device nodes, SGLang flags, cache folders, compile-cache key fields."""
    standin: StandIn
    """The simulator's stand-in tool(s)."""

    @property
    def tool(self) -> str:
        """The vendor tool's name, e.g. "npu-smi"."""
        return self.adapter.tool

    @property
    def sglang_refusal(self) -> str:
        """Why `engine: sglang` cannot run on this vendor ("" when it can)."""
        return sglang_refusal(self.type_name)
