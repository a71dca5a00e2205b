"""`kunlun-agent`: run a node agent."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from kunlun_common.errors import ConfigError
from kunlun_common.logs import setup_logging
from node_agent.settings import AgentSettings


def build_settings(argv: list[str] | None = None) -> AgentSettings:
    p = argparse.ArgumentParser(prog="kunlun-agent", description="Run a Kunlun Platform node agent.")
    p.add_argument("--config", required=True, help="the node's device-plugin-config.yaml")
    p.add_argument("--endpoints", required=True, help="comma-separated replica addresses host:port")
    p.add_argument("--cert-dir", required=True, help="certificate folder (ca.crt, agent/<node>.crt/.key)")
    p.add_argument("--state-dir", help="node-local state folder (default: /var/lib/kunlun-agent/<node>)")
    p.add_argument(
        "--heartbeat-interval", type=float, default=1.0, help="seconds between heartbeats (default 1)"
    )
    p.add_argument(
        "--ack-timeout", type=float, default=3.0, help="fail over after this many seconds without ack"
    )
    p.add_argument("--log-level", default="info")
    a = p.parse_args(argv)
    endpoints = tuple(e.strip() for e in a.endpoints.split(",") if e.strip())
    if not endpoints:
        raise ConfigError("--endpoints: expected at least one replica address host:port")
    for ep in endpoints:
        if ":" not in ep:
            raise ConfigError(f"--endpoints: {ep!r} is not host:port")
    if a.heartbeat_interval <= 0 or a.ack_timeout <= a.heartbeat_interval:
        raise ConfigError("--ack-timeout must be greater than --heartbeat-interval, both > 0")
    state_dir = a.state_dir or os.path.join(
        "/var/lib/kunlun-agent", os.path.basename(a.config).rsplit(".", 1)[0]
    )
    return AgentSettings(
        config_path=a.config,
        endpoints=endpoints,
        cert_dir=a.cert_dir,
        state_dir=state_dir,
        heartbeat_interval_s=a.heartbeat_interval,
        ack_timeout_s=a.ack_timeout,
    )


def main(argv: list[str] | None = None) -> None:
    try:
        settings = build_settings(argv)
        setup_logging("kunlun-agent")
        from node_agent.agent import Agent

        agent = Agent(settings)
    except ConfigError as e:
        print(f"kunlun-agent: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        asyncio.run(agent.run())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
