"""An agent speaks only for its own node: its instance report is cut to the instances assigned to
that node before anything of it is written (the node comes from the agent's certificate).

Without this, node-b's agent could overwrite the observed status of node-a's instances (making
gateways drop them) or create status keys without bound. With it, the keys an agent can cause to be
written are bounded by its node's assignments (and MAX_REPORTED per report).
"""

from __future__ import annotations

import structlog

from controlplane.feeds import Feeds
from kunlun_common.api import agent_pb2

log = structlog.get_logger("reports")
MAX_REPORTED = 1024
"""At most this many instance statuses are taken from one report (a node runs far fewer)."""


def owned_report(feeds: Feeds, node: str, report: agent_pb2.InstanceReport) -> agent_pb2.InstanceReport:
    """`report` without the statuses of instances that are not assigned to `node`."""
    instances = feeds.index.instances
    keep = [
        st for st in report.instances if (i := instances.get(st.instance_id)) is not None and i.node == node
    ]
    refused = len(report.instances) - len(keep)
    if refused == 0 and len(keep) <= MAX_REPORTED:
        return report
    if refused:
        log.warning(
            "report for instances not assigned to this node refused",
            node=node,
            refused=refused,
            first=[st.instance_id[:80] for st in report.instances if st not in keep][:3],
        )
    out = agent_pb2.InstanceReport()
    out.CopyFrom(report)
    del out.instances[:]
    out.instances.extend(keep[:MAX_REPORTED])
    return out
