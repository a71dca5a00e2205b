"""etcd membership, as the `kunlun-admin` user: list, add and remove members.

etcd lets only the root role change membership, and the replicas' etcd user `kunlun` is kept out
of it on purpose (a replica that could change members could also take the cluster's quorum away),
so these calls carry the administrator's certificate and go to etcd directly: they are also what
an operator needs when the control plane is down because a member failed.

Replacing a failed member: remove it (etcd refuses a removal that would lose quorum: it runs with
its strict reconfiguration check), add the new one by its peer URL, then start it with
`--initial-cluster-state=existing` and the initial cluster that `add` returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlparse

import grpc
from aetcd import rpc

from controlplane.store.admin import admin_channel
from controlplane.store.backup import AdminTarget, first_answering
from kunlun_common.errors import InvalidInput, NotFoundError, TemporaryError
from kunlun_common.messages import msg
from kunlun_common.retry import retry_until

T = TypeVar("T")

CHANGE_RETRY_S = 20.0
"""How long a membership change refused as `unhealthy cluster` is retried (etcd's strict
reconfiguration check wants every member connected for 5 s, e.g. just after a start)."""


class ClusterNotReady(TemporaryError):
    """etcd refused a membership change because the change could cost quorum right now."""


async def _change(target: AdminTarget, what: str, fn: Callable[[rpc.ClusterStub], Awaitable[T]]) -> T:
    """A membership change on the first member that answers, retried while etcd calls the cluster
    unhealthy (until CHANGE_RETRY_S)."""

    async def once(ep: str, ch: grpc.aio.Channel) -> T:
        try:
            return await fn(rpc.ClusterStub(ch))
        except grpc.aio.AioRpcError as e:
            detail = e.details() or ""
            if "unhealthy cluster" in detail or "not enough started members" in detail:
                raise ClusterNotReady(
                    msg(
                        "store.members.etcd_refused_etcd_changes",
                        "etcd refused {what}: {detail} (etcd changes members only while every member has been connected for 5 s and the change keeps quorum); wait until `kunlun-cli cluster etcd member list` shows every member healthy, then run it again",
                        what=what,
                        detail=detail,
                    )
                ) from None
            raise

    return await retry_until(lambda: first_answering(target, what, once), CHANGE_RETRY_S, base=0.5)


@dataclass(frozen=True)
class Member:
    """One etcd member as the cluster lists it, with its health asked at its own client URL."""

    id: int
    name: str
    """Empty until the member has started and joined."""
    peer_urls: tuple[str, ...]
    client_urls: tuple[str, ...]
    learner: bool = False
    healthy: bool = False
    leader: bool = False
    db_size_bytes: int = 0
    error: str = ""

    @property
    def started(self) -> bool:
        return bool(self.name)

    @property
    def id_hex(self) -> str:
        return f"{self.id:x}"


def _member(m: object) -> Member:
    return Member(
        id=int(m.ID),  # type: ignore[attr-defined]
        name=str(m.name),  # type: ignore[attr-defined]
        peer_urls=tuple(m.peerURLs),  # type: ignore[attr-defined]
        client_urls=tuple(m.clientURLs),  # type: ignore[attr-defined]
        learner=bool(m.isLearner),  # type: ignore[attr-defined]
    )


async def _health(target: AdminTarget, m: Member) -> Member:
    if not m.client_urls:
        return Member(m.id, m.name, m.peer_urls, m.client_urls, m.learner, error="not started")
    try:
        async with admin_channel(m.client_urls[0], target.cert_dir) as ch:
            st = await rpc.MaintenanceStub(ch).Status(rpc.StatusRequest(), timeout=min(3.0, target.timeout_s))
    except grpc.aio.AioRpcError as e:
        return Member(m.id, m.name, m.peer_urls, m.client_urls, m.learner, error=f"{e.code().name}")
    errors = "; ".join(st.errors)
    return Member(
        m.id,
        m.name,
        m.peer_urls,
        m.client_urls,
        m.learner,
        healthy=not errors and st.leader != 0,
        leader=int(st.leader) == m.id,
        db_size_bytes=int(st.dbSize),
        error=errors,
    )


async def list_members(target: AdminTarget, health: bool = True) -> tuple[str, list[Member]]:
    """(cluster id hex, members), each member's health asked at its own client URL."""

    async def one(ep: str, ch: grpc.aio.Channel) -> tuple[str, list[Member]]:
        resp = await rpc.ClusterStub(ch).MemberList(rpc.MemberListRequest(), timeout=target.timeout_s)
        return f"{int(resp.header.cluster_id):x}", [_member(m) for m in resp.members]

    cid, members = await first_answering(target, "the member list", one)
    if health:
        members = list(await asyncio.gather(*(_health(target, m) for m in members)))
    return cid, members


def check_peer_url(url: str) -> str:
    u = urlparse(url)
    if u.scheme != "https" or not u.hostname or not u.port or u.path not in ("", "/"):
        raise InvalidInput(
            msg(
                "store.members.peer_urls_not_https",
                "--peer-urls: {url!r} is not https://HOST:PORT (the new member's peer address, e.g. https://10.0.0.14:2380); members speak TLS to each other",
                url=url,
            )
        )
    return url.rstrip("/")


async def add_member(
    target: AdminTarget, name: str, peer_urls: tuple[str, ...]
) -> tuple[Member, list[Member]]:
    """Add a member by its peer URLs; returns it (not started yet) and every member."""
    urls = tuple(check_peer_url(u) for u in peer_urls)
    _, current = await list_members(target, health=False)
    if any(m.name == name for m in current):
        raise InvalidInput(
            msg(
                "store.members.name_member_named_exists",
                "name: a member named {name!r} exists already; remove it first or pick another name",
                name=name,
            )
        )

    async def add(stub: rpc.ClusterStub) -> tuple[Member, list[Member]]:
        resp = await stub.MemberAdd(rpc.MemberAddRequest(peerURLs=list(urls)), timeout=target.timeout_s)
        new = _member(resp.member)
        new = Member(new.id, name, new.peer_urls, new.client_urls, new.learner)
        return new, [new if int(m.ID) == new.id else _member(m) for m in resp.members]

    return await _change(target, "the member add", add)


async def remove_member(target: AdminTarget, which: str) -> tuple[Member, list[Member]]:
    """Remove the member named `which` (or with that hex id); returns it and the members left."""
    _, current = await list_members(target, health=False)
    found = [m for m in current if which in (m.name, m.id_hex)]
    if not found:
        names = ", ".join(f"{m.name or '(unstarted)'} {m.id_hex}" for m in current)
        raise NotFoundError(
            msg(
                "store.members.no_etcd_member_named",
                "no etcd member named {which!r} (members: {names}); give a name or hex id from the list",
                which=which,
                names=names,
            )
        )
    if len(current) == 1:
        raise InvalidInput(
            msg(
                "store.members.cluster_has_one_member",
                "the cluster has one member; removing it would destroy the cluster",
            )
        )
    gone = found[0]

    async def remove(stub: rpc.ClusterStub) -> list[Member]:
        resp = await stub.MemberRemove(rpc.MemberRemoveRequest(ID=gone.id), timeout=target.timeout_s)
        return [_member(m) for m in resp.members]

    # ask a member other than the one removed, so the answer comes from one that stays
    others = tuple(
        ep for ep in target.endpoints if not any(ep.rstrip("/") == u.rstrip("/") for u in gone.client_urls)
    )
    t = AdminTarget(others or target.endpoints, target.cert_dir, target.timeout_s)
    return gone, await _change(t, "the member remove", remove)
