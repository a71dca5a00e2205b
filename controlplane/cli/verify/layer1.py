"""Layer 1, device visibility: every declared device Ready; each device's memory as the vendor tool
reports it (the tool runs on the node now, through its agent); each node's topology matrix well formed
and, with `--declared FILE`, equal to the declaration's."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from controlplane.cli.client import CliError
from controlplane.cli.verify.api import Api
from controlplane.cli.verify.common import READY, Options, cut, devices_evidence, text_table, tool_command
from controlplane.cli.verify.model import Evidence, LayerResult, evidence
from kunlun_common.api import agent_pb2, types_pb2
from kunlun_common.i18n import _, error_text
from kunlun_common.messages import Message, msg, msg_list, plain
from kunlun_common.states import DeviceState

MEMORY_TOLERANCE = 0.05
"""The agent's own cross-check tolerance (node_agent/vendors/base.py): tools print a little less."""


def run(api: Api, opts: Options) -> LayerResult:
    r = LayerResult(1, "Device visibility")
    nodes = sorted(api.nodes(), key=lambda n: n.name)
    devices = [d for n in nodes for d in n.devices]
    listed = api.devices()
    ev = devices_evidence(listed)
    not_ready = [d for d in listed if d.status != READY]
    r.add(
        "every declared device Ready",
        msg_list(
            "verify.l1.ready",
            "{ready}/{total} Ready{parts}",
            [
                msg(
                    "verify.l1.not_ready",
                    "{name} {state}: {reason}",
                    name=d.name,
                    state=DeviceState.of(d.status),
                    reason=d.status_reason,
                )
                for d in not_ready
            ],
            bullet="; ",
            sep="",
            ready=len(listed) - len(not_ready),
            total=len(listed),
        ),
        msg(
            "verify.l1.ready_threshold",
            "{total}/{total} Ready (none Unknown, Error or Unhealthy)",
            total=len(listed),
        ),
        bool(listed) and not not_ready,
        ev,
    )
    _memory(api, r, nodes)
    _topology(r, nodes, opts.declared)
    if not devices:
        r.checkpoints[-1].note = "the cluster has no devices"
    return r


def _memory(api: Api, r: LayerResult, nodes: list[types_pb2.Node]) -> None:
    rows: list[tuple[str, ...]] = []
    bad: list[Message] = []
    exact = 0
    evs: list[Evidence] = []
    for n in nodes:
        try:
            reading = api.tool_reading(n.name)
        except CliError as e:
            bad.append(
                msg("verify.l1.no_reading", "{node}: no tool reading ({e})", node=n.name, e=plain(str(e)))
            )
            evs.append(evidence(f"kunlun.v1.LedgerService/NodeToolReading node={n.name}", str(e)))
            continue
        seen: dict[str, tuple[agent_pb2.ToolReading, agent_pb2.ToolDevice]] = {}
        for rd in reading.readings:
            for td in rd.devices:
                if td.name:
                    seen[td.name] = (rd, td)
            raw = rd.raw_output if not rd.error else rd.error
            evs.append(evidence(tool_command(list(rd.command), n.name), raw))
        for d in n.devices:
            platform_mb = d.hbm_memory_mb or d.total_memory_mb
            got = seen.get(d.name)
            if got is None:
                bad.append(
                    msg("verify.l1.not_reported", "{name}: the vendor tool does not report it", name=d.name)
                )
                rows.append((d.name, str(platform_mb), "-", "missing"))
                continue
            rd, td = got
            tool_mb = td.memory_total_mb
            if tool_mb < 0:
                rows.append((d.name, str(platform_mb), "N/A", "tool prints no memory"))
                bad.append(
                    msg(
                        "verify.l1.memory_unavailable",
                        "{name}: {tool} prints its memory as unavailable",
                        name=d.name,
                        tool=rd.command[0],
                    )
                )
                continue
            ok = abs(tool_mb - platform_mb) <= MEMORY_TOLERANCE * platform_mb
            exact += tool_mb == platform_mb
            rows.append(
                (
                    d.name,
                    str(platform_mb),
                    str(tool_mb),
                    "equal" if tool_mb == platform_mb else ("within 5 %" if ok else "DIFFERENT"),
                )
            )
            if not ok:
                bad.append(
                    msg(
                        "verify.l1.memory_differs",
                        "{name}: platform {platform_mb} MB, {tool} {tool_mb} MB",
                        name=d.name,
                        platform_mb=platform_mb,
                        tool=rd.command[0],
                        tool_mb=tool_mb,
                    )
                )
    total = sum(len(n.devices) for n in nodes)
    matched = sum(1 for row in rows if row[3] in ("equal", "within 5 %"))
    table = evidence(
        msg("verify.ev.memory_table", "kunlun-cli verify (platform MEMORY vs vendor tool)"),
        text_table(["DEVICE", "PLATFORM MB", "TOOL MB", "RESULT"], rows),
    )
    r.add(
        "memory equal to the vendor tool's figure",
        msg_list(
            "verify.l1.memory",
            "{matched}/{total} match ({exact} exactly){parts}",
            [cut(b, 200) for b in bad[:5]],
            bullet="; ",
            sep="",
            matched=matched,
            total=total,
            exact=exact,
        ),
        msg(
            "verify.l1.memory_threshold",
            "{total}/{total} equal (within the agent's {tolerance:.0%} tolerance)",
            total=total,
            tolerance=MEMORY_TOLERANCE,
        ),
        total > 0 and not bad,
        table,
        *evs,
    )


def _matrix(n: types_pb2.Node) -> list[list[int]]:
    return [list(d.topology_distance) for d in n.devices]


def _declared_matrices(files: tuple[str, ...]) -> dict[str, list[list[int]]]:
    """Node name -> topology matrix, from device-plugin-config files (declaration order)."""
    out: dict[str, list[list[int]]] = {}
    for f in files:
        try:
            data = yaml.safe_load(Path(f).read_text())
            node = str(data["node"]["name"])
            rows: list[list[int]] = []
            for group in data["devices"]:
                topo = group.get("topology_distance") or []
                if "device_ids" in group:
                    rows.extend([int(x) for x in row] for row in topo)
                else:
                    rows.append([int(x) for x in topo])
        except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError) as e:
            raise CliError(
                _("--declared {f}: not a readable device-plugin-config file ({e})").format(
                    f=f, e=error_text(e)
                )
            ) from None
        out[node] = rows
    return out


def _topology(r: LayerResult, nodes: list[types_pb2.Node], declared_files: tuple[str, ...]) -> None:
    declared = _declared_matrices(declared_files)
    problems: list[Message] = []
    evs: list[Evidence] = []
    for n in nodes:
        m = _matrix(n)
        size = len(m)
        evs.append(
            evidence(
                msg(
                    "verify.ev.topology",
                    "kunlun-cli node describe {node} (topology_distance of each device)",
                    node=n.name,
                ),
                text_table(
                    ["", *[d.name.split("/", 1)[1] for d in n.devices]],
                    [[d.name.split("/", 1)[1], *row] for d, row in zip(n.devices, m, strict=True)],
                ),
            )
        )
        for i, row in enumerate(m):
            if len(row) != size:
                problems.append(
                    msg(
                        "verify.l1.row_length",
                        "{name}: {count} distances for {size} devices",
                        name=n.devices[i].name,
                        count=len(row),
                        size=size,
                    )
                )
        if any(len(row) != size for row in m):
            continue
        for i in range(size):
            if m[i][i] != 0:
                problems.append(
                    msg(
                        "verify.l1.diagonal",
                        "{name}: distance to itself {distance}, expected 0",
                        name=n.devices[i].name,
                        distance=m[i][i],
                    )
                )
            for j in range(i + 1, size):
                if m[i][j] != m[j][i]:
                    problems.append(
                        msg(
                            "verify.l1.asymmetric",
                            "{node}: distance {i}->{j} is {ij} but {j}->{i} is {ji}",
                            node=n.name,
                            i=i,
                            j=j,
                            ij=m[i][j],
                            ji=m[j][i],
                        )
                    )
                if m[i][j] < 0:
                    problems.append(
                        msg("verify.l1.negative", "{node}: negative distance {i}->{j}", node=n.name, i=i, j=j)
                    )
        if n.name in declared and declared[n.name] != m:
            problems.append(
                msg(
                    "verify.l1.differs",
                    "{node}: graph {graph} differs from the declared {declared}",
                    node=n.name,
                    graph=json.dumps(m),
                    declared=json.dumps(declared[n.name]),
                )
            )
    unknown = sorted(set(declared) - {n.name for n in nodes})
    problems.extend(
        msg("verify.l1.unknown_node", "{node}: declared (--declared) but not in the cluster", node=name)
        for name in unknown
    )
    compared = sorted(set(declared) & {n.name for n in nodes})
    r.add(
        "topology matrix as declared",
        msg_list(
            "verify.l1.topology",
            "{parts}",
            [
                (
                    msg("verify.l1.well_formed", "{count} node matrices well formed", count=len(nodes))
                    if not problems
                    else msg_list("verify.l1.problems", "{parts}", problems[:5], bullet="", sep="; ")
                ),
                *(
                    [
                        msg(
                            "verify.l1.compared",
                            "; compared with the declaration of {nodes}",
                            nodes=", ".join(compared),
                        )
                    ]
                    if compared
                    else []
                ),
            ],
            bullet="",
            sep="",
        ),
        (
            msg(
                "verify.l1.topology_threshold_declared",
                "square, symmetric, zero diagonal, equal to --declared",
            )
            if declared
            else msg("verify.l1.topology_threshold", "square, symmetric, zero diagonal")
        ),
        bool(nodes) and not problems,
        *evs,
        note="" if declared else "give --declared NODE-CONFIG.yaml to compare with the files themselves",
    )
