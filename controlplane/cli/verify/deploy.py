"""Deploying a test workload for a layer: submit, wait until every instance is Running and a gateway
routes it, and the first burst-ready gateway address (with an API key of the run's own when the
gateway asks for one)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from controlplane.cli.client import CliError
from controlplane.cli.verify.api import Api, running
from controlplane.cli.verify.load import Connection, chat_body
from kunlun_common.api import workload_pb2
from kunlun_common.i18n import _


@dataclass
class Deployed:
    summary: workload_pb2.WorkloadSummary
    gateway: str
    api_key: str
    ready_s: float
    """Seconds from submission until every instance was Running with an endpoint."""


def _one_request(address: str, model: str, api_key: str) -> int:
    async def go() -> int:
        conn = Connection(address)
        try:
            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            reply, _body = await asyncio.wait_for(
                conn.post("/v1/chat/completions", chat_body(model), headers), 10
            )
            return reply.status
        except (OSError, ConnectionError, TimeoutError):
            return 0
        finally:
            await conn.close()

    return asyncio.run(go())


def deploy(api: Api, spec: workload_pb2.WorkloadSpec, timeout_s: float) -> Deployed:
    """Submit `spec` and wait until it serves through a gateway (CliError naming what is missing)."""
    started = time.monotonic()
    api.submit(spec)
    deadline = started + timeout_s
    summary = api.workload(spec.name)
    while len(running(summary)) < spec.replicas:
        failed = [i for i in summary.instances if i.phase == "Failed"]
        if failed:
            raise CliError(
                _("test workload {name}: instance {id} Failed: {reason}").format(
                    name=spec.name, id=failed[0].id, reason=failed[0].reason
                )
            )
        if time.monotonic() > deadline:
            states = (
                ", ".join(f"{i.id} {i.phase} {i.reason}".strip() for i in summary.instances) or "no instances"
            )
            raise CliError(
                _("test workload {name} not Running within {timeout_s:.0f} s ({states})").format(
                    name=spec.name, timeout_s=timeout_s, states=states
                )
            )
        time.sleep(0.5)
        summary = api.workload(spec.name)
    ready_s = time.monotonic() - started
    gateways = api.gateways()
    if not gateways:
        raise CliError(_("no inference gateway is registered (`kunlun-cli gateway list`): start one"))
    address, key = gateways[0].address, ""
    while True:
        status = _one_request(address, spec.name, key)
        if status == 200:
            break
        if status == 401 and not key:
            key = api.api_key()
            continue
        if time.monotonic() > deadline:
            raise CliError(
                _("gateway {name} ({address}) does not route {name2}: last status {status}").format(
                    name=gateways[0].name, address=address, name2=spec.name, status=status
                )
            )
        time.sleep(0.5)
    return Deployed(summary, address, key, ready_s)


SAMPLE_MARGIN_MS = 1500
"""After an engine turns Running its chips' usage is written and the next tool sample shows it."""


def running_since(summary: workload_pb2.WorkloadSummary) -> int:
    """Milliseconds since the epoch after which the tool's samples show every instance Running."""
    return max((i.ready_at_unix_ms for i in summary.instances), default=0) + SAMPLE_MARGIN_MS
