"""Lease keep-alive isolation against real etcd: a refresh that times out fails alone.

Many leases share one keep-alive stream. Before, one timed-out refresh reset the stream and failed
every refresh in flight with it; under load that turned one slow answer into every node lease of a
replica missing its refresh at once (and heartbeat acks withheld).
"""

from __future__ import annotations

import asyncio

import pytest

from controlplane.store import EtcdStore
from controlplane.store.leases import LeaseKeeper
from kunlun_common.errors import TemporaryError


async def test_a_timed_out_refresh_fails_alone(store: EtcdStore) -> None:
    leases = [await store.lease_grant(30) for _ in range(20)]
    try:
        assert await store.lease_keepalive(leases[0]) > 0  # the stream is open
        keeper = LeaseKeeper(store._lease, 2.0, streams=1)  # every lease on one stream
        hurried = asyncio.create_task(keeper.refresh(leases[0], timeout_s=0.0001))
        others = [asyncio.create_task(keeper.refresh(lease)) for lease in leases[1:]]
        with pytest.raises(TemporaryError, match="did not answer the keep-alive"):
            await hurried
        ttls = await asyncio.gather(*others)
        assert all(ttl > 0 for ttl in ttls), ttls  # every other refresh in flight was answered
        assert keeper.timeouts == 1 and keeper.resent == 0
        assert await keeper.refresh(leases[0]) > 0  # and refreshing goes on
    finally:
        await keeper.close()
        for lease in leases:
            await store.lease_revoke(lease)
