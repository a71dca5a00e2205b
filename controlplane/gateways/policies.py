"""Per-workload routing policies (`gateway-policies/<workload>`); "default" (or empty) removes the
record, so the gateways fall back to their own default policy."""

from __future__ import annotations

from controlplane import keys
from controlplane.store import EtcdStore
from controlplane.workloads.spec import NAME_RE
from kunlun_common.api import gateway_pb2
from kunlun_common.clock import now_ms
from kunlun_common.errors import InvalidInput
from kunlun_common.messages import Message, msg
from kunlun_common.traffic import ROUTING_POLICIES

DEFAULT = ("", "default")
"""Policy names that mean "the gateway's default"."""


def policy_message(rec: dict[str, object]) -> gateway_pb2.RoutingPolicy:
    return gateway_pb2.RoutingPolicy(
        workload=str(rec.get("workload", "")),
        policy=str(rec.get("policy", "")),
        balance_factor=float(str(rec.get("balance_factor", 0.0))),
        prefix_chars=int(str(rec.get("prefix_chars", 0))),
        updated_by=str(rec.get("by", "")),
        updated_at_unix_ms=int(str(rec.get("at_ms", 0))),
    )


def problems(p: gateway_pb2.RoutingPolicy) -> list[Message]:
    """What is wrong with a policy a caller sent, one line per field (the first one is reported)."""
    out: list[Message] = []
    if not NAME_RE.match(p.workload):
        out.append(
            msg(
                "gateway.policy.workload_not_valid_name",
                "workload: {workload!r} is not a valid name",
                workload=p.workload,
            )
        )
    if p.policy not in (*ROUTING_POLICIES, *DEFAULT):
        out.append(
            msg(
                "gateway.policy.policy_expected_one_default",
                "policy: expected one of {items} or default, found {policy!r}",
                items=", ".join(ROUTING_POLICIES),
                policy=p.policy,
            )
        )
    if p.balance_factor and not 1.0 <= p.balance_factor <= 10.0:
        out.append(
            msg(
                "gateway.policy.balance_factor_expected_found",
                "balance_factor: expected 1..10, found {balance_factor}",
                balance_factor=p.balance_factor,
            )
        )
    if not 0 <= p.prefix_chars <= 65536:
        out.append(
            msg(
                "gateway.policy.prefix_chars_expected_found",
                "prefix_chars: expected 0..65536, found {prefix_chars}",
                prefix_chars=p.prefix_chars,
            )
        )
    return out


async def set_policy(store: EtcdStore, p: gateway_pb2.RoutingPolicy, who: str) -> gateway_pb2.RoutingPolicy:
    found = problems(p)
    if found:
        raise InvalidInput(found[0])
    if p.policy in DEFAULT:
        await store.delete(keys.gateway_policy(p.workload))
        return gateway_pb2.RoutingPolicy(workload=p.workload, policy="default", updated_by=who)
    rec: dict[str, object] = {
        "workload": p.workload,
        "policy": p.policy,
        "balance_factor": p.balance_factor,
        "prefix_chars": p.prefix_chars,
        "by": who,
        "at_ms": now_ms(),
    }
    await store.put(keys.gateway_policy(p.workload), keys.encode(rec))
    return policy_message(rec)


async def list_policies(store: EtcdStore) -> list[gateway_pb2.RoutingPolicy]:
    kvs, _ = await store.get_prefix(keys.GATEWAY_POLICIES)
    return sorted((policy_message(keys.decode(kv.value)) for kv in kvs), key=lambda p: p.workload)
