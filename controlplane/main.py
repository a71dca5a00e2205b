"""`kunlun-platform`: run one control-plane replica."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from controlplane import failpoints
from controlplane.election import ElectionSettings
from controlplane.settings import ReplicaSettings
from kunlun_common.errors import ConfigError, KunlunError
from kunlun_common.i18n import _, error_text
from kunlun_common.logs import log_json, setup_logging
from kunlun_common.settings import from_mapping, load_yaml_mapping


def build_settings(argv: list[str] | None = None) -> ReplicaSettings:
    p = argparse.ArgumentParser(
        prog="kunlun-platform", description="Run a Kunlun Platform control-plane replica."
    )
    p.add_argument("--config", help="YAML settings file (keys: the ReplicaSettings fields)")
    p.add_argument("--name", help="replica name (must match its certificate)")
    p.add_argument("--listen", help="host:port for the gRPC API (default 127.0.0.1:50051)")
    p.add_argument("--advertise", help="host:port clients use to reach this replica")
    p.add_argument("--cert-dir", help="certificate folder from `kunlun-cli certs init`")
    p.add_argument("--etcd-endpoints", help="comma-separated etcd URLs, e.g. https://127.0.0.1:2379")
    p.add_argument("--election-ttl", type=int, help="leader lease TTL in seconds (default 5)")
    p.add_argument("--renew-deadline", type=float, help="leader renew deadline in seconds (default 3)")
    p.add_argument("--retry-period", type=float, help="leader retry period in seconds (default 1)")
    p.add_argument("--node-lease-ttl", type=int, help="node liveness lease TTL in seconds (default 10)")
    p.add_argument(
        "--metrics-listen", help="host:port of the Prometheus exporter (HTTPS, mTLS; port 0: free)"
    )
    p.add_argument("--log-level", help="debug, info, warning, error")
    p.add_argument(
        "--log-format",
        choices=["json", "console"],
        help="log lines as JSON or readable (default: JSON unless a tty)",
    )
    p.add_argument(
        "--package-store-dir", help="this replica's model package folder ({name}: the replica name)"
    )
    p.add_argument(
        "--package-store-quota-bytes", type=int, help="most bytes of packages in the cluster store"
    )
    p.add_argument(
        "--profile-dir",
        help="folder of run-time profiles (Chrome trace files), written while the scheduler settings switch advanced_profiling on",
    )
    p.add_argument(
        "--allow-test-failpoints",
        action="store_true",
        help="tests only: honour KUNLUN_FAILPOINT_* variables (controlplane/failpoints.py); without it they are refused",
    )
    a = p.parse_args(argv)
    failpoints.from_env(os.environ, a.allow_test_failpoints)  # refuses a failpoint without the flag
    data: dict[str, Any] = load_yaml_mapping(a.config) if a.config else {}
    source = a.config or "flags"
    if a.profile_dir is not None:
        data["profiling"] = {**(data.get("profiling") or {}), "dir": a.profile_dir}
    for flag, key in (
        ("name", "name"),
        ("listen", "listen"),
        ("advertise", "advertise"),
        ("cert_dir", "cert_dir"),
        ("node_lease_ttl", "node_lease_ttl_s"),
        ("log_level", "log_level"),
        ("log_format", "log_format"),
        ("metrics_listen", "metrics_listen"),
        ("package_store_dir", "package_store_dir"),
        ("package_store_quota_bytes", "package_store_quota_bytes"),
    ):
        if getattr(a, flag) is not None:
            data[key] = getattr(a, flag)
    if a.etcd_endpoints:
        data["etcd_endpoints"] = [e.strip() for e in a.etcd_endpoints.split(",") if e.strip()]
    election = dict(data.get("election") or {})
    for flag, key in (
        ("election_ttl", "ttl_s"),
        ("renew_deadline", "renew_deadline_s"),
        ("retry_period", "retry_period_s"),
    ):
        if getattr(a, flag) is not None:
            election[key] = getattr(a, flag)
    if election:
        data["election"] = election
    settings = from_mapping(ReplicaSettings, data, source)
    if isinstance(settings.election, dict):  # pragma: no cover - from_mapping builds nested dataclasses
        settings = ReplicaSettings(**{**settings.__dict__, "election": ElectionSettings(**settings.election)})
    return settings


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        settings = build_settings(argv)
        points = failpoints.from_env(os.environ, failpoints.ALLOW_FLAG in argv)
    except ConfigError as e:
        print(_("kunlun-platform: {error}").format(error=error_text(e)), file=sys.stderr)
        sys.exit(2)
    setup_logging("kunlun-platform", settings.log_level, log_json(settings.log_format))
    from controlplane.replica import serve

    try:
        try:
            import uvloop

            uvloop.install()
        except ImportError:  # pragma: no cover
            pass
        asyncio.run(serve(settings, points))
    except ConfigError as e:
        print(_("kunlun-platform: {error}").format(error=error_text(e)), file=sys.stderr)
        sys.exit(2)
    except KunlunError as e:
        print(_("kunlun-platform: {error}").format(error=error_text(e)), file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
