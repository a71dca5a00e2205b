"""Settings of a node agent (`kunlun-agent`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AgentSettings:
    """How an agent finds its replicas and paces its heartbeats."""

    config_path: str
    """The node's device-plugin-config.yaml."""
    endpoints: tuple[str, ...]
    """Replica addresses (host:port); the agent talks to one at a time and fails over in order."""
    cert_dir: str
    """Certificate folder: ca.crt and agent/<node>.crt/.key (the certificate names the node)."""
    state_dir: str
    """Where the agent keeps node-local state (stand-in tool state, shims, instance folders)."""
    heartbeat_interval_s: float = 1.0
    """How often a heartbeat (with device samples) is sent."""
    ack_timeout_s: float = 3.0
    """A replica that does not acknowledge a heartbeat within this long is left for the next."""
    connect_timeout_s: float = 5.0
    """Deadline for connecting and registering with one replica."""
    server_name: str = "localhost"
    """Name checked against the replicas' certificates."""
