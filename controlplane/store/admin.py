"""etcd administration with the `kunlun-admin` certificate, loaded only for these calls:
turning on etcd's own authentication (etcd 3.4 RBAC with client-cert users) and defragmenting.

With `--client-cert-auth`, etcd takes the user name from the CN of the client certificate. After
`enable_etcd_auth`:

- user `kunlun` (the replicas' etcd client certificate) has role `kunlun`: read and write on the
  cluster prefix only; it cannot defragment, snapshot or change members;
- user `kunlun-admin` (the administrator's certificate, loaded only for maintenance calls) and
  `root` have the root role.

Only certificates of the etcd CA reach etcd at all (see kunlun_common.pki); this is the second
wall. Idempotent: it may run again on a cluster that already has auth enabled (it then
authenticates as `kunlun-admin`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
from aetcd import rpc

from controlplane.store.contract import prefix_end
from kunlun_common.errors import ConfigError
from kunlun_common.messages import msg
from kunlun_common.pki import ETCD_ADMIN, ETCD_USER, etcd_client_paths

ROLE = "kunlun"
CLUSTER_PREFIX = "/kunlun/"
"""Keys the replicas may read and write (controlplane.keys.ROOT lives under it)."""


def _channel(endpoint_host_port: str, cert_dir: Path, server_name: str) -> grpc.aio.Channel:
    p = etcd_client_paths(cert_dir, ETCD_ADMIN)
    try:
        creds = grpc.ssl_channel_credentials(p.ca.read_bytes(), p.key.read_bytes(), p.cert.read_bytes())
    except OSError as e:
        raise ConfigError(
            msg(
                "store.admin.cannot_read_etcd_admin",
                "{filename}: cannot be read ({strerror}); the etcd admin certificate folder must hold etcd-ca.crt and etcd-client/{etcd_admin}.crt|key (made by `kunlun-cli certs init`)",
                filename=e.filename,
                strerror=e.strerror,
                etcd_admin=ETCD_ADMIN,
            )
        ) from None
    return grpc.aio.secure_channel(
        endpoint_host_port,
        creds,
        options=[("grpc.default_authority", server_name), ("grpc.max_receive_message_length", 64 << 20)],
    )


def admin_channel(endpoint: str, cert_dir: Path) -> grpc.aio.Channel:
    """A channel to one etcd member (`https://HOST:PORT` or `HOST:PORT`) as `kunlun-admin`."""
    host_port = endpoint.split("://", 1)[-1]
    return _channel(host_port, cert_dir, host_port.rsplit(":", 1)[0].strip("[]"))


async def _ignore_exists(call: Any) -> None:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        if "already exists" not in (e.details() or "") and "already granted" not in (e.details() or ""):
            raise


async def enable_auth_async(endpoint: str, cert_dir: Path, prefix: str = CLUSTER_PREFIX) -> None:
    """Create the users and roles and enable authentication through one member (idempotent)."""
    async with admin_channel(endpoint, cert_dir) as ch:
        auth = rpc.AuthStub(ch)
        t = 10.0
        no_password = rpc.UserAddOptions(no_password=True)
        for user in ("root", ETCD_ADMIN, ETCD_USER):
            await _ignore_exists(
                auth.UserAdd(rpc.AuthUserAddRequest(name=user, options=no_password), timeout=t)
            )
        for user in ("root", ETCD_ADMIN):
            await _ignore_exists(
                auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=user, role="root"), timeout=t)
            )
        await _ignore_exists(auth.RoleAdd(rpc.AuthRoleAddRequest(name=ROLE), timeout=t))
        perm = rpc.Permission(
            permType=rpc.Permission.READWRITE, key=prefix.encode(), range_end=prefix_end(prefix)
        )
        await auth.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(name=ROLE, perm=perm), timeout=t)
        await _ignore_exists(
            auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=ETCD_USER, role=ROLE), timeout=t)
        )
        await auth.AuthEnable(rpc.AuthEnableRequest(), timeout=t)


def enable_etcd_auth(endpoints: tuple[str, ...], cert_dir: Path, prefix: str = CLUSTER_PREFIX) -> None:
    """Create the users and roles and enable authentication, through the first endpoint that answers.

    Blocking (it runs its own event loop): for launchers and tools, not for async code."""
    last: Exception | None = None
    for ep in endpoints:
        try:
            asyncio.run(enable_auth_async(ep, cert_dir, prefix))
            return
        except grpc.aio.AioRpcError as e:
            last = e
    raise ConfigError(
        msg(
            "store.admin.could_not_enable_etcd",
            "could not enable etcd authentication on {items}: {last}",
            items=", ".join(endpoints),
            last=last,
        )
    )


async def defragment(endpoint: str, cert_dir: Path, timeout_s: float = 60.0) -> None:
    """Defragment one member's backend (root role: the `kunlun-admin` certificate)."""
    async with admin_channel(endpoint, cert_dir) as ch:
        await rpc.MaintenanceStub(ch).Defragment(rpc.DefragmentRequest(), timeout=timeout_s)
