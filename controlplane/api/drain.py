"""A replica's drain, as its servicers see it: once it begins, every open stream (agents'
`Connect`, gateways' watches, log and package downloads) ends with UNAVAILABLE, which their clients
take as "fail over to the next replica", and new streams are refused the same way. The `@rpc_stream`
wrapper (controlplane/api/rpc.py) enforces it; `Replica.drain` begins it and waits until the
streams are closed (controlplane/replica.py)."""

from __future__ import annotations

import asyncio

from kunlun_common.messages import Message, msg


class DrainState:
    """Shared by all servicers of one replica."""

    def __init__(self, replica_name: str) -> None:
        self.replica_name = replica_name
        self.begun = asyncio.Event()
        """Set once the drain began; never cleared (the process exits afterwards)."""
        self.open_streams = 0
        self.streams_ended = 0
        """Streams that were open when the drain began and were ended by it."""
        self._closed = asyncio.Event()

    def message(self) -> Message:
        return msg(
            "replica.draining",
            "replica {name} is draining and about to exit; reconnect to another replica",
            name=self.replica_name,
        )

    def opened(self) -> None:
        self.open_streams += 1
        self._closed.clear()

    def closed(self) -> None:
        self.open_streams -= 1
        if self.open_streams <= 0:
            self._closed.set()

    def begin(self) -> None:
        if self.open_streams <= 0:
            self._closed.set()
        self.begun.set()

    async def wait_closed(self, timeout_s: float) -> bool:
        """After `begin`: wait until no stream is open (True) or `timeout_s` passed (False)."""
        try:
            await asyncio.wait_for(self._closed.wait(), timeout_s)
            return True
        except TimeoutError:
            return self.open_streams <= 0
