"""Lease keep-alive isolation against real etcd: a refresh that times out fails alone.

Many leases share a keep-alive stream. Before, one timed-out refresh reset the stream and failed
every refresh in flight with it; under load that turned one slow answer into every node lease of a
replica missing its refresh at once (and heartbeat acks withheld).
"""

from __future__ import annotations

import asyncio

from controlplane.store import EtcdStore
from controlplane.store.leases import LeaseKeeper
from kunlun_common.errors import TemporaryError


async def test_a_timed_out_refresh_fails_alone(store: EtcdStore) -> None:
    leases = [await store.lease_grant(30) for _ in range(40)]
    keeper = LeaseKeeper(store._lease, 2.0, streams=1)  # every lease on one stream
    try:
        assert await keeper.refresh(leases[0]) > 0  # the stream is open
        timed_out = 0
        for _ in range(5):  # the hurried refresh is queued behind 20 others: it almost always times out
            before = [asyncio.create_task(keeper.refresh(lease)) for lease in leases[1:21]]
            hurried = asyncio.create_task(keeper.refresh(leases[0], timeout_s=0.0001))
            after = [asyncio.create_task(keeper.refresh(lease)) for lease in leases[21:]]
            try:
                await hurried
            except TemporaryError as e:
                assert "did not answer the keep-alive" in str(e)
                timed_out += 1
            ttls = await asyncio.gather(*before, *after)
            assert all(ttl > 0 for ttl in ttls), ttls  # every other refresh in flight was answered
            if timed_out:
                break
        assert timed_out == 1 and keeper.timeouts == 1 and keeper.resent == 0
        assert await keeper.refresh(leases[0]) > 0  # and refreshing goes on
    finally:
        await keeper.close()
        for lease in leases:
            await store.lease_revoke(lease)
