"""gRPC message size limits of the agent channel, shared by both of its ends.

The replica pushes a node's whole assignment set in one message and the agent sends its whole
instance report in one message. Each direction's limit is set from the same constant on the side
that sends and on the side that receives, so a message one end may send is never refused by the
other (gRPC's default receive limit is 4 MiB on every channel and server that does not set one).
"""

from __future__ import annotations

TO_AGENT_MAX_BYTES = 64 << 20
"""Largest message a replica sends an agent (an assignment set). Each distinct spec travels once per
set and a workload record is capped at 1 MiB (controlplane/workloads/records.py), so this holds the
specs of 64 different workloads on one node; a set that would pass it is not sent (the replica logs
it and the agent keeps its last set)."""

FROM_AGENT_MAX_BYTES = 4 << 20
"""Largest message an agent sends a replica (registration, heartbeat, instance report); gRPC's
default, kept as the replica server's receive limit for every client."""


def replica_server_options() -> list[tuple[str, int]]:
    """The replica's gRPC server: sends assignment sets up to TO_AGENT_MAX_BYTES."""
    return [
        ("grpc.max_send_message_length", TO_AGENT_MAX_BYTES),
        ("grpc.max_receive_message_length", FROM_AGENT_MAX_BYTES),
    ]


def agent_channel_options() -> list[tuple[str, int]]:
    """The agent's channel to a replica: the mirror of `replica_server_options`."""
    return [
        ("grpc.max_send_message_length", FROM_AGENT_MAX_BYTES),
        ("grpc.max_receive_message_length", TO_AGENT_MAX_BYTES),
    ]
