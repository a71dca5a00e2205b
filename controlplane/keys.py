"""The etcd key layout and value encoding of the Device Resource Graph — documented in one place.

All keys live under `/kunlun/v1/`. Values are JSON objects with a `"schema": N` field; readers
ignore fields they do not know, so a later release can read what an earlier one wrote, and a reader
that finds a newer `schema` than it knows logs it and uses what it understands.

| key                                | written by            | value (JSON)                                  | lease            |
|------------------------------------|-----------------------|-----------------------------------------------|------------------|
| election/leader                    | election              | {"schema", "name", "address", "since_ms"}     | leader lease     |
| leader-state                       | leader (fenced)       | {"schema", "name", "epoch", "tick", "at_ms"}  | -                |
| replicas/<replica>                 | each replica          | ReplicaInfo (proto JSON)                      | replica lease    |
| nodes/<node>                       | replica for its agent | Node incl. Devices (proto JSON), no telemetry | -                |
| alive/<node>                       | replica for its agent | {"schema", "replica", "lease", "since_ms"}    | node lease       |
| node-status/<node>                 | leader (fenced)       | {"schema", "ready", "since_ms", "reason"}     | -                |
| telemetry/<node>                   | replica for its agent | {"schema", "at_ms", "devices": {name: tele}}  | -                |
| workloads/<id>                     | API (goal state)      | Workload incl. spec (proto JSON)              | -                |
| workload-names/<name>              | API (goal state)      | {"schema", "id"} — CAS-created: names unique  | -                |
| cordons/<node>                     | API (goal state)      | {"schema", "cordoned", "drain", "by", "at_ms"}| -                |
| scheduler/config                   | API (goal state)      | {"schema", "yaml", "by", "at_ms"}             | -                |
| instances/<instance id>            | leader (fenced)       | Instance (proto JSON): placement, phase, why  | -                |
| instance-slots/<workload id>/<slot>| leader (fenced)       | {"schema", "instance"}: the one live incarnation of an ordinal (slot `<n>`, canary `c<n>`; a rolling update's successor `<n>/g<generation>`) | - |
| alloc/<node>/<type>:<index>        | leader (fenced)       | {"schema", "instance", "workload", "at_ms"}   | -                |
| gateway-keys/<id>                  | API (GatewayService)  | {"schema","id","name","hash" (SHA-256; the secret is never stored),"prefix",...} | - |
| gateway-policies/<workload>        | API (GatewayService)  | {"schema","workload","policy","balance_factor","prefix_chars","by","at_ms"} | - |
| gateways/<gateway>                 | replica for gateway   | GatewayInfo (proto JSON): name, address, pid, version, replica | gateway lease |
| gateway-stats/<gateway>            | replica for gateway   | GatewayStats (proto JSON): the gateway's cumulative requests, errors, latency buckets per workload and version; written when changed, at most every 3 s | gateway lease |
| instance-status/<instance id>      | replica for its agent | InstanceStatus + node (proto JSON), changes   | -                |
| request-endpoints/<name>           | API (EndpointService) | RequestEndpoint (proto JSON): Request-as-a-Service definition, versioned | - |
| rollouts/<workload id>             | API (goal: create, promote/abort requests); leader (fenced: phase, step, weight) | Rollout (proto JSON) | - |
| packages/<digest>                  | API (PackageService)  | the stored model package record (controlplane/package_store.py) | - |
| package-trust/<key id>             | API (PackageService)  | a trusted package-signing public key and who added it | - |
| restoring                          | `cluster restore`     | {"schema", "started_at_ms", "backup_revision", "backup_cluster_id"}: a restore is writing | - |
| package-policy                     | API (PackageService)  | {"schema", "require_signed_packages", "by", "at_ms"} (controlplane/package_policy.py) | - |
| watch-heartbeats/<replica>         | each replica          | {"schema", "seq", "at_ms"}: rewritten every few seconds to time its own watch (controlplane/watch_lag.py) | replica lease |

An ordinal has at most one instance: instance ids are unique per incarnation
(`<workload id>-<ordinal>-<revision>`), so creation compares the ordinal's `instance-slots/` key
with create revision 0 and writes it in the same transaction; a removal deletes both.

A device is held by at most one instance: an allocation is committed in one fenced transaction
that also compares the `alloc/` key's create revision with 0 (free when planned), so two plans that
race can never both take a device.

Liveness is the `alive/<node>` key: it exists while the node's lease lives. A node is Ready while it
exists; its devices are then shown with the status the agent reported, else `Unavailable`.
Telemetry is sampled at 1 Hz on the nodes but written here only every `telemetry_snapshot_s` or on
a large change: etcd holds state changes, not samples.
"""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message

ROOT = "/kunlun/v1/"
LEADER = ROOT + "election/leader"
LEADER_STATE = ROOT + "leader-state"
REPLICAS = ROOT + "replicas/"
NODES = ROOT + "nodes/"
ALIVE = ROOT + "alive/"
NODE_STATUS = ROOT + "node-status/"
TELEMETRY = ROOT + "telemetry/"
AUDIT = ROOT + "audit/"
WORKLOADS = ROOT + "workloads/"
WORKLOAD_NAMES = ROOT + "workload-names/"
CORDONS = ROOT + "cordons/"
SCHEDULER_CONFIG = ROOT + "scheduler/config"
INSTANCES = ROOT + "instances/"
INSTANCE_SLOTS = ROOT + "instance-slots/"
ALLOC = ROOT + "alloc/"
INSTANCE_STATUS = ROOT + "instance-status/"
ROLLOUTS = ROOT + "rollouts/"
GATEWAY_STATS = ROOT + "gateway-stats/"
GATEWAY_KEYS = ROOT + "gateway-keys/"
GATEWAY_POLICIES = ROOT + "gateway-policies/"
GATEWAYS = ROOT + "gateways/"
REQUEST_ENDPOINTS = ROOT + "request-endpoints/"
PACKAGES = ROOT + "packages/"
PACKAGE_TRUST = ROOT + "package-trust/"
PACKAGE_POLICY = ROOT + "package-policy"
SCHEMA = 1

WATCH_HEARTBEATS = ROOT + "watch-heartbeats/"
"""Each replica's heartbeat key, timed from its write until its own watch delivers it (watch lag)."""
RESTORING = ROOT + "restoring"
"""Exists while `kunlun-cli cluster restore` writes the keys (first written, last deleted);
replicas do not start serving while it exists, so none acts on a half-restored cluster."""
NEVER_RESTORED = (LEADER, LEADER_STATE, REPLICAS, ALIVE, GATEWAYS, GATEWAY_STATS, RESTORING, WATCH_HEARTBEATS)
"""Per-process and per-term keys a restore from backup never writes back (most are also bound to
leases, which a backup leaves out anyway): a restored cluster elects its leader afresh, replicas
and gateways register again, and nodes are alive again once their agents reconnect."""
LIVE_MARKERS = (LEADER, REPLICAS)
"""Keys that exist only while replicas run against the cluster (bound to their leases)."""


def replica(name: str) -> str:
    return REPLICAS + name


def watch_heartbeat(name: str) -> str:
    return WATCH_HEARTBEATS + name


def node(name: str) -> str:
    return NODES + name


def alive(name: str) -> str:
    return ALIVE + name


def node_status(name: str) -> str:
    return NODE_STATUS + name


def telemetry(name: str) -> str:
    return TELEMETRY + name


def last_segment(key: str) -> str:
    return key.rsplit("/", 1)[-1]


def encode(obj: dict[str, Any]) -> bytes:
    """Encode a plain record; adds the schema version."""
    return json.dumps({"schema": SCHEMA, **obj}, sort_keys=True, separators=(",", ":")).encode()


def decode(raw: bytes) -> dict[str, Any]:
    """Decode a plain record (unknown fields are kept; callers read what they know)."""
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("record is not a JSON object")
    return data


def encode_message(msg: Message) -> bytes:
    """Encode a proto message as versioned JSON (snake_case field names)."""
    body = json_format.MessageToDict(msg, preserving_proto_field_name=True)
    return json.dumps({"schema": SCHEMA, "message": body}, sort_keys=True, separators=(",", ":")).encode()


def decode_message(raw: bytes, msg: Message) -> Message:
    """Decode into `msg` (which is returned), ignoring fields a later release added."""
    data = json.loads(raw)
    json_format.ParseDict(data.get("message", {}), msg, ignore_unknown_fields=True)
    return msg


def workload(wid: str) -> str:
    return WORKLOADS + wid


def workload_name(name: str) -> str:
    return WORKLOAD_NAMES + name


def cordon(node_name: str) -> str:
    return CORDONS + node_name


def instance(iid: str) -> str:
    return INSTANCES + iid


def instance_slot(workload_id: str, ordinal: int, variant: str = "") -> str:
    """The key that names the one live incarnation of a workload's ordinal (canaries apart)."""
    return f"{INSTANCE_SLOTS}{workload_id}/{'c' if variant else ''}{ordinal}"


def alloc(device: str) -> str:
    """Allocation key of a device named `<node>/<type>:<index>`."""
    return ALLOC + device


def alloc_device(key: str) -> str:
    return key[len(ALLOC) :]


def instance_status(iid: str) -> str:
    return INSTANCE_STATUS + iid


def rollout(wid: str) -> str:
    return ROLLOUTS + wid


def gateway_stats(name: str) -> str:
    return GATEWAY_STATS + name


def gateway_key(kid: str) -> str:
    return GATEWAY_KEYS + kid


def gateway_policy(workload_name: str) -> str:
    return GATEWAY_POLICIES + workload_name


def gateway(name: str) -> str:
    return GATEWAYS + name


def request_endpoint(name: str) -> str:
    return REQUEST_ENDPOINTS + name
