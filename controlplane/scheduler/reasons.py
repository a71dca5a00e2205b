"""The filters' per-node reasons as messages, so that kunlun-cli shows their explanation in its
reader's language while the reason code stays as it is (a stable identifier, like a JSON key).

The scheduler keeps writing its reasons as the plain English texts the filters make
(`filters.insufficient_memory` and the others; `unplaced_reasons` and the comparisons of every tick
use them); `reason_message` reads such a text back into a message whose English text is the same
text, byte for byte, only where one is shown or stored beside its message (`reconcile.blocked_message`,
kunlun-cli's `workload describe`). A text of another form (an older or newer replica's) is shown as
it is. tests/test_i18n_reasons.py checks that every code and every formatter's output reads back
into a message of its own with the same English text.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from controlplane.scheduler import filters as f
from kunlun_common.messages import Message, msg, plain
from kunlun_common.names import sglang_refusal_message


def _bare(code: str) -> Message | None:
    """A reason that is only its code, with its explanation."""
    if code == f.NO_FREE_DEVICE:
        return msg("filter.no_free_device", "NoFreeDevice")
    if code == f.CARD_TYPE_MISMATCH:
        return msg("filter.card_type_mismatch", "CardTypeMismatch")
    if code == f.PIN_MISMATCH:
        return msg("filter.pin_mismatch", "PinMismatch")
    if code == f.DEVICE_NOT_READY:
        return msg("filter.device_not_ready", "DeviceNotReady")
    if code == f.NODE_NOT_READY:
        return msg("filter.node_not_ready", "NodeNotReady")
    if code == f.NODE_CORDONED:
        return msg("filter.node_cordoned", "NodeCordoned")
    if code == f.NO_P2P_GROUP:
        return msg("filter.no_p2p_group", "NoP2PGroup")
    if code == f.UNSUPPORTED_DTYPE:
        return msg("filter.unsupported_dtype", "UnsupportedDtype")
    if code == f.UNSUPPORTED_ENGINE:
        return msg("filter.unsupported_engine", "UnsupportedEngine")
    if code == f.INSUFFICIENT_MEMORY:
        return msg("filter.insufficient_memory", "InsufficientMemory")
    if code == f.TOO_HOT:
        return msg("filter.too_hot", "TooHot")
    if code == f.INSUFFICIENT_DEVICES:
        return msg("filter.insufficient_devices", "InsufficientDevices")
    return None


def _dtype(m: re.Match[str]) -> Message:
    return msg(
        "filter.unsupported_dtype.detail",
        "UnsupportedDtype ({needed} not in [{supported}])",
        needed=m["needed"],
        supported=m["supported"],
    )


def _memory(m: re.Match[str]) -> Message:
    return msg(
        "filter.insufficient_memory.detail",
        "InsufficientMemory (needs {needed} MB, {free} free)",
        needed=m["needed"],
        free=m["free"],
    )


def _hot(m: re.Match[str]) -> Message:
    if m["op"] == ">":
        return msg("filter.too_hot.detail", "TooHot ({temp} C > {limit} C)", temp=m["temp"], limit=m["limit"])
    return msg("filter.too_hot.at_limit", "TooHot ({temp} C >= {limit} C)", temp=m["temp"], limit=m["limit"])


def _devices(m: re.Match[str]) -> Message:
    return msg(
        "filter.insufficient_devices.detail",
        "InsufficientDevices (needs {needed}, {on_node} on node)",
        needed=m["needed"],
        on_node=m["on_node"],
    )


def _engine(m: re.Match[str]) -> Message:
    why = sglang_refusal_message(m["type"])
    return msg(
        "filter.unsupported_engine.detail",
        "UnsupportedEngine (sglang on {device_type}: {why})",
        device_type=m["type"],
        why=why if why is not None and str(why) == m["why"] else m["why"],
    )


_DETAILED: tuple[tuple[re.Pattern[str], Callable[[re.Match[str]], Message]], ...] = (
    (re.compile(r"UnsupportedDtype \((?P<needed>\S*) not in \[(?P<supported>[^\]]*)\]\)"), _dtype),
    (re.compile(r"InsufficientMemory \(needs (?P<needed>-?\d+) MB, (?P<free>-?\d+) free\)"), _memory),
    (re.compile(r"TooHot \((?P<temp>\S+) C (?P<op>>=?) (?P<limit>\S+) C\)"), _hot),
    (re.compile(r"InsufficientDevices \(needs (?P<needed>\d+), (?P<on_node>\d+) on node\)"), _devices),
    (re.compile(r"UnsupportedEngine \(sglang on (?P<type>[a-z0-9]+): (?P<why>.*)\)"), _engine),
)
_MORE_NODES = re.compile(r"\((?P<count>\d+) more nodes\)")


def reason_message(text: str) -> Message:
    """A filter's reason text (a bare code or `Code (detail)`) as a message with the same English
    text; any other text as it is."""
    bare = _bare(text)
    if bare is not None:
        return bare
    for pattern, make in _DETAILED:
        m = pattern.fullmatch(text)
        if m is not None:
            made = make(m)
            return made if str(made) == text else plain(text)
    return plain(text)


def more_nodes(count: int) -> str:
    """The entry that stands for `count` further nodes with the same reason (`reconcile.bounded_reasons`)."""
    return f"({count} more nodes)"


def node_message(key: str) -> Message | str:
    """A key of the per-node reasons: a node's name as it is, `(N more nodes)` as a message."""
    m = _MORE_NODES.fullmatch(key)
    if m is None:
        return key
    return msg("filter.more_nodes", "({count} more nodes)", count=int(m["count"]))


def node_reason_message(node: str, reason: str) -> Message:
    """`node: reason` (one line of the per-node reasons) as a message."""
    return msg(
        "instance.node_reason", "{node}: {reason}", node=node_message(node), reason=reason_message(reason)
    )
