"""`kunlun-agent`: run a node agent."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from kunlun_common.errors import ConfigError
from kunlun_common.i18n import _, error_text
from kunlun_common.logs import log_json, setup_logging
from kunlun_common.messages import msg
from kunlun_common.trace_ring import ProfileOutput
from node_agent.settings import AgentSettings, ExecutorSettings

SCHEDULER_NODE_GRACE_S = 8.0  # the scheduler's default node_not_ready_grace_seconds


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
    p.add_argument(
        "--node-service-listen",
        default="",
        help="host:port of the agent's NodeService (logs, for replicas); default: the node's address, free port",
    )
    p.add_argument(
        "--metrics-listen",
        default="",
        help="host:port of the Prometheus exporter (HTTPS, `monitoring` client certificates; port 0: free)",
    )
    p.add_argument(
        "--profile-max-files",
        type=int,
        default=ProfileOutput.max_files,
        help=f"most run-time profile files kept (default {ProfileOutput.max_files}; the oldest is deleted first)",
    )
    p.add_argument(
        "--profile-max-file-bytes",
        type=int,
        default=ProfileOutput.max_file_bytes,
        help=f"largest run-time profile file (default {ProfileOutput.max_file_bytes})",
    )
    p.add_argument(
        "--profile-dir",
        default="",
        help="folder of run-time profiles (Chrome trace files), written while the scheduler settings switch advanced_profiling on",
    )
    e = p.add_argument_group("engines")
    d = ExecutorSettings()
    e.add_argument(
        "--allow-unsandboxed",
        action="store_true",
        help="run engines even when the node offers no isolation (no cgroup controller, no namespaces)",
    )
    e.add_argument(
        "--test-engine-fallback",
        action="store_true",
        help="serve `engine: sglang` workloads with kunlun-test-engine when SGLang is not installed (demo, tests)",
    )
    e.add_argument(
        "--disconnect-stop",
        type=float,
        default=d.disconnect_stop_s,
        metavar="SECONDS",
        help=f"stop every engine after this long without any replica (default {d.disconnect_stop_s:g}; keep it "
        f"below the scheduler's node_not_ready_grace_seconds, {SCHEDULER_NODE_GRACE_S:g} by default)",
    )
    e.add_argument(
        "--engine-python", default=d.engine_python, help="interpreter with SGLang (default python3)"
    )
    e.add_argument(
        "--engine-user",
        default=d.engine_user,
        help=f"run engines as this unprivileged user (default {d.engine_user}; '' runs them as the agent's user)",
    )
    e.add_argument(
        "--no-engine-seccomp",
        dest="engine_seccomp",
        action="store_false",
        help="do not load the engines' system-call allowlist (only where the host lacks libseccomp)",
    )
    e.add_argument(
        "--no-engine-read-only-root",
        dest="engine_read_only_root",
        action="store_false",
        help="leave the host file system writable in the engines' view (only where remounting fails)",
    )
    e.add_argument(
        "--engine-memory-limit-mb",
        type=int,
        default=None,
        help="default host-memory limit per instance (the spec's env KUNLUN_MEMORY_LIMIT_MB wins)",
    )
    e.add_argument(
        "--engine-cpu-cores",
        type=float,
        default=None,
        help="default CPU limit per instance (the spec's env KUNLUN_CPU_CORES wins)",
    )
    e.add_argument("--health-path", default=d.health_path, help="engine health probe path (default /health)")
    e.add_argument("--probe-interval", type=float, default=d.probe_interval_s, help="seconds between probes")
    e.add_argument("--probe-timeout", type=float, default=d.probe_timeout_s, help="deadline of one probe")
    e.add_argument(
        "--probe-failures",
        type=int,
        default=d.probe_failure_threshold,
        help="restart a Running engine after this many failed probes in a row",
    )
    e.add_argument(
        "--startup-timeout",
        type=float,
        default=d.startup_timeout_s,
        help="restart an engine not healthy by then",
    )
    e.add_argument("--restart-backoff", type=float, default=d.restart_backoff_s, help="first restart delay")
    e.add_argument(
        "--restart-backoff-max", type=float, default=d.restart_backoff_max_s, help="longest restart delay"
    )
    e.add_argument("--stop-grace", type=float, default=d.stop_grace_s, help="SIGTERM to SIGKILL delay")
    e.add_argument(
        "--stop-engines-on-exit",
        action="store_true",
        help="stop the engines when the agent exits on SIGTERM/SIGINT (default: leave them to the next agent)",
    )
    p.add_argument(
        "--require-signed-config",
        action="store_true",
        help="refuse a device declaration without a valid CONFIG.sig by a key in --trusted-keys",
    )
    p.add_argument("--trusted-keys", default="", help="folder of trusted signers' public keys (*.pub)")
    p.add_argument(
        "--require-signed-packages",
        action="store_true",
        help="launch from a model package only when signed by a trusted key (--trusted-keys and the "
        "cluster's; the cluster policy `model policy set --require-signed-packages` does the same everywhere)",
    )
    p.add_argument(
        "--package-cache-mb",
        type=int,
        default=ExecutorSettings.package_cache_mb,
        help="most MiB of model packages kept on the node (unused ones are evicted, least recently used first)",
    )
    p.add_argument(
        "--package-pull-rate-mb",
        type=float,
        default=ExecutorSettings.package_pull_rate_mb_s,
        help="most MiB/s one package pull from the control plane takes (0: no cap)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--log-format",
        choices=["json", "console"],
        help="log lines as JSON or readable (default: JSON unless a tty)",
    )
    a = p.parse_args(argv)
    endpoints = tuple(e.strip() for e in a.endpoints.split(",") if e.strip())
    if not endpoints:
        raise ConfigError(
            msg("agent.flags.no_endpoints", "--endpoints: expected at least one replica address host:port")
        )
    for ep in endpoints:
        if ":" not in ep:
            raise ConfigError(
                msg("agent.flags.endpoint", "--endpoints: {endpoint!r} is not host:port", endpoint=ep)
            )
    if a.heartbeat_interval <= 0 or a.ack_timeout <= a.heartbeat_interval:
        raise ConfigError(
            msg(
                "agent.flags.ack_timeout", "--ack-timeout must be greater than --heartbeat-interval, both > 0"
            )
        )
    for flag, value in (
        ("--disconnect-stop", a.disconnect_stop),
        ("--probe-interval", a.probe_interval),
        ("--probe-timeout", a.probe_timeout),
        ("--probe-failures", a.probe_failures),
        ("--startup-timeout", a.startup_timeout),
        ("--restart-backoff", a.restart_backoff),
        ("--restart-backoff-max", a.restart_backoff_max),
    ):
        if value <= 0:
            raise ConfigError(
                msg(
                    "agent.flags.positive",
                    "{flag} must be greater than 0, got {value}",
                    flag=flag,
                    value=value,
                )
            )
    if a.metrics_listen:
        from kunlun_common.metrics_http import split_listen

        split_listen(a.metrics_listen, "--metrics-listen")
    if a.package_cache_mb < 0 or a.package_pull_rate_mb < 0:
        raise ConfigError(
            msg(
                "agent.flags.package_limits",
                "--package-cache-mb and --package-pull-rate-mb must not be negative (0: no limit)",
            )
        )
    if a.stop_grace < 0:
        raise ConfigError(
            msg(
                "agent.flags.stop_grace", "--stop-grace must not be negative, got {value}", value=a.stop_grace
            )
        )
    if not a.health_path.startswith("/"):
        raise ConfigError(
            msg(
                "agent.flags.health_path",
                "--health-path must start with '/', got {value!r}",
                value=a.health_path,
            )
        )
    executor = ExecutorSettings(
        health_path=a.health_path,
        probe_interval_s=a.probe_interval,
        probe_timeout_s=a.probe_timeout,
        probe_failure_threshold=a.probe_failures,
        startup_timeout_s=a.startup_timeout,
        restart_backoff_s=a.restart_backoff,
        restart_backoff_max_s=max(a.restart_backoff_max, a.restart_backoff),
        stop_grace_s=a.stop_grace,
        disconnect_stop_s=a.disconnect_stop,
        allow_unsandboxed=a.allow_unsandboxed,
        test_engine_fallback=a.test_engine_fallback,
        engine_python=a.engine_python,
        engine_user=a.engine_user or None,
        engine_seccomp=a.engine_seccomp,
        engine_read_only_root=a.engine_read_only_root,
        memory_limit_mb=a.engine_memory_limit_mb,
        cpu_cores=a.engine_cpu_cores,
        stop_engines_on_exit=a.stop_engines_on_exit,
        require_signed_packages=a.require_signed_packages,
        trusted_keys_dir=a.trusted_keys,
        package_cache_mb=a.package_cache_mb,
        package_pull_rate_mb_s=a.package_pull_rate_mb,
    )
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
        node_service_listen=a.node_service_listen,
        metrics_listen=a.metrics_listen,
        executor=executor,
        require_signed_config=a.require_signed_config,
        trusted_keys_dir=a.trusted_keys,
        profiling=ProfileOutput(
            dir=a.profile_dir, max_files=a.profile_max_files, max_file_bytes=a.profile_max_file_bytes
        ),
    )


def main(argv: list[str] | None = None) -> None:
    try:
        settings = build_settings(argv)
        fmt = argparse.ArgumentParser(add_help=False)
        fmt.add_argument("--log-level", default="info")
        fmt.add_argument("--log-format", default="")
        known, _rest = fmt.parse_known_args(argv)
        setup_logging("kunlun-agent", known.log_level, log_json(known.log_format))
        if settings.executor.disconnect_stop_s >= SCHEDULER_NODE_GRACE_S:
            print(
                _(
                    "kunlun-agent: warning: --disconnect-stop {stop:g} is not below the scheduler's default "
                    "node grace ({grace:g}s): an instance cut off with its node may run twice"
                ).format(stop=settings.executor.disconnect_stop_s, grace=SCHEDULER_NODE_GRACE_S),
                file=sys.stderr,
            )
        from node_agent.agent import Agent
        from node_agent.declaration_trust import load_declaration

        agent = Agent(settings, load_declaration(settings))
    except ConfigError as e:
        print(_("kunlun-agent: {error}").format(error=error_text(e)), file=sys.stderr)
        sys.exit(2)
    from node_agent.agent import AgentLoopEnded

    try:
        asyncio.run(agent.run())
    except KeyboardInterrupt:
        pass
    except AgentLoopEnded as e:
        print(
            _("kunlun-agent: stopped: a loop ended on its own ({error}); restart the agent").format(
                error=error_text(e)
            ),
            file=sys.stderr,
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
