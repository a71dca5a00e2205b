"""Gateway pieces without processes: policies, the routable set, ejection, keys, settings, config."""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass

import pytest

from controlplane.api.gateway_service import route_states
from gateway.auth import ApiKeys
from gateway.backends import Backend, Registry
from gateway.main import build_settings
from gateway.routing import LeastOutstanding, PrefixAffinity, RoundRobin, prompt_prefix
from gateway.settings import GatewaySettings
from kunlun_common.api import gateway_pb2, workload_pb2
from kunlun_common.errors import ConfigError
from kunlun_common.traffic import key_hash


@dataclass(eq=False)
class Inst:
    instance_id: str
    inflight: int = 0


def test_round_robin_takes_turns() -> None:
    rr = RoundRobin()
    insts = [Inst("a"), Inst("b"), Inst("c")]
    assert [rr.pick(insts, None).instance_id for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_least_outstanding_takes_the_less_loaded_of_two() -> None:
    lo = LeastOutstanding()
    busy, idle = Inst("busy", 5), Inst("idle", 0)
    assert {lo.pick([busy, idle], None).instance_id for _ in range(50)} == {"idle"}
    many = [Inst(f"i{n}", n) for n in range(8)]
    picks = Counter(lo.pick(many, None).instance_id for _ in range(4000))
    assert picks["i7"] == 0 and picks["i0"] > picks["i3"] > picks["i6"]  # never the worst; skewed to light


def test_prefix_affinity_is_sticky_consistent_and_bounded() -> None:
    pa = PrefixAffinity(balance_factor=1.25)
    insts = [Inst(f"i{n}") for n in range(4)]
    pa.update(insts)
    home = {f"prompt {k}": pa.pick(insts, f"prompt {k}").instance_id for k in range(200)}
    assert all(pa.pick(insts, k).instance_id == v for k, v in home.items())
    assert len(set(home.values())) == 4
    # removing one instance moves only the keys it had
    rest = [i for i in insts if i.instance_id != "i0"]
    pa.update(rest)
    moved = {k for k, v in home.items() if pa.pick(rest, k).instance_id != v}
    assert moved == {k for k, v in home.items() if v == "i0"}
    # bounded load: a loaded home sheds to the next instance on the ring
    pa.update(insts)
    key = "shared system prompt"
    first = pa.pick(insts, key)
    first.inflight = 3  # others idle: capacity ceil(1.25 * 4 / 4) = 2
    second = pa.pick(insts, key)
    assert second is not first
    for i in insts:
        i.inflight = 1  # evenly loaded: capacity ceil(1.25 * 5 / 4) = 2, the home keeps it
    assert pa.capacity(insts) == 2 and pa.pick(insts, key) is first
    assert pa.pick(insts, None) in insts  # no key: least outstanding


def test_prompt_prefix_of_every_request_shape() -> None:
    chat = {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": [{"text": "hi"}]}]}
    assert prompt_prefix(chat, 256) == "sys\nhi"
    assert prompt_prefix({"prompt": "abcdef"}, 3) == "abc"
    assert prompt_prefix({"prompt": ["first", "second"]}, 256) == "first"
    assert prompt_prefix({"prompt": [1, 2, 3]}, 2) == "1,2"
    assert prompt_prefix({"text": "native"}, 256) == "native"
    assert prompt_prefix({"input_ids": [5, 6]}, 256) == "5,6"
    assert prompt_prefix({}, 256) is None


def test_api_keys() -> None:
    keys = ApiKeys(required=True)
    keys.set([key_hash("secret-1")])
    assert keys.check(b"Bearer secret-1") is None
    assert "missing" in str(keys.check(None))
    assert "malformed" in str(keys.check(b"Basic abc"))
    assert "revoked" in str(keys.check(b"Bearer secret-2"))
    assert ApiKeys(required=False).check(None) is None


def settings(**kw: object) -> GatewaySettings:
    return GatewaySettings(static_endpoints=("w=127.0.0.1:1",), **kw)  # type: ignore[arg-type]


def eps(*pairs: tuple[str, str]) -> list[workload_pb2.Endpoint]:
    return [workload_pb2.Endpoint(instance_id=i, address=a, workload="w") for i, a in pairs]


def test_registry_applies_snapshots_and_ejects() -> None:
    reg = Registry(settings(eject_s=5.0, max_inflight_per_instance=2))
    reg.apply_endpoints(eps(("a", "127.0.0.1:1"), ("b", "127.0.0.1:2")), 7)
    wl = reg.workloads["w"]
    a, b = wl.backends
    assert reg.revision == 7 and reg.synced
    reg.apply_endpoints(eps(("a", "127.0.0.1:1")), 8)
    assert wl.backends == [a] and b.removed and not a.removed  # same object kept, the other dropped
    reg.apply_endpoints(eps(("a", "127.0.0.1:1"), ("b", "127.0.0.1:2")), 9)
    b = wl.backends[1]
    # a refused connect ejects at once; more failures while ejected do not stretch the ejection
    reg.failed(b, "connect", "refused", False)
    until = b.ejected_until
    assert until > time.monotonic() + 4
    reg.failed(b, "connect", "refused", False)
    assert b.ejected_until == until
    assert all(reg.pick(wl, None, []) is a for _ in range(5))
    # a reset on a reused connection needs a second one in a row
    reg.failed(a, "reset", "closed", True)
    assert a.ejected_until == 0.0
    reg.succeeded(a)
    reg.failed(a, "reset", "closed", True)
    assert a.ejected_until == 0.0
    # everyone ejected: tried anyway rather than refusing the workload
    reg.failed(a, "connect", "refused", False)
    assert reg.pick(wl, None, []) in (a, b)
    assert isinstance(reg.pick(wl, None, [a, b]), str)
    # a health check pass lifts an ejection
    reg.health(b, True)
    assert b.ejected_until == 0.0 and reg.pick(wl, None, [a]) is b
    # in-flight limit
    b.inflight = 2
    why = reg.pick(wl, None, [a])
    assert isinstance(why, str) and "in-flight limit (2)" in why


def test_no_instance_reason_names_workload_and_why() -> None:
    reg = Registry(settings())
    reg.apply_config(
        gateway_pb2.GatewayConfig(
            workloads=[
                gateway_pb2.WorkloadRouteState(
                    name="q", phase="Pending", replicas=1, reason="1 Pending (no room)"
                )
            ],
            policies=[gateway_pb2.RoutingPolicy(workload="w", policy="prefix_affinity", prefix_chars=32)],
        )
    )
    assert reg.no_instance_reason("q") == "workload 'q' has no Ready instance (Pending: 1 Pending (no room))"
    assert reg.known("q") and not reg.known("zzz")
    reg.apply_endpoints(eps(("a", "127.0.0.1:1")))
    assert reg.workloads["w"].policy.name == "prefix_affinity" and reg.workloads["w"].prefix_chars == 32


def test_route_states_say_why_instances_are_not_ready() -> None:
    w = workload_pb2.Workload(id="w1", spec=workload_pb2.WorkloadSpec(name="chat", replicas=3))
    insts = [
        workload_pb2.Instance(id="i1", workload_id="w1", phase="Running", endpoint="h:1"),
        workload_pb2.Instance(id="i2", workload_id="w1", phase="Pending", reason="no free ascend device"),
    ]
    (st,) = route_states([w], insts)
    assert (st.name, st.ready, st.replicas) == ("chat", 1, 3)
    assert st.reason == "1 Pending (no free ascend device); 1 not created yet"


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="endpoints: name the replicas"):
        GatewaySettings()
    with pytest.raises(ConfigError, match="cert_dir"):
        GatewaySettings(endpoints=("127.0.0.1:1",))
    with pytest.raises(ConfigError, match="default_policy"):
        settings(default_policy="random")
    with pytest.raises(ConfigError, match="tls_cert and tls_key"):
        settings(tls_cert="x.pem")
    with pytest.raises(ConfigError, match="WORKLOAD=HOST:PORT"):
        GatewaySettings(static_endpoints=("127.0.0.1:1",))
    s = build_settings(
        [
            "--static-endpoints",
            "a=127.0.0.1:1, a=127.0.0.1:2",
            "--health-interval",
            "0",
            "--policy",
            "least_outstanding",
        ]
    )
    assert s.static_map() == {"a": ["127.0.0.1:1", "127.0.0.1:2"]}
    assert s.health_check_interval_s == 0 and s.default_policy == "least_outstanding"


def test_backend_status_json() -> None:
    b = Backend(workload_pb2.Endpoint(instance_id="a", address="127.0.0.1:9", workload="w"), settings())
    b.ejected_until = math.inf
    j = b.json(time.monotonic())
    assert j["ejected"] and j["ejected_for_s"] == -1 and j["address"] == "127.0.0.1:9"
