"""The only package of ``fedcomp`` that imports Flower: records, and fedcomp for any app.

Conversions between fedcomp's objects and Flower records live here; the mod and
strategy wrapper that bring fedcomp's compression to any Flower app live in
:mod:`fedcomp.flower.interop` and are re-exported.

Keeping Flower out of the rest of the library lets every codec, the wire format and
the feedback memories be tested without Flower running, and confines API changes of
Flower (which moves fast between minor releases) to this file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedcomp.federated.downlink import DownlinkMessage
from fedcomp.federated.replies import ReplyError, parse_digest
from fedcomp.flower.interop import CompressedUplink, compression_mod

__all__ = [
    "DIGEST_KEY",
    "METRICS_PREFIX",
    "NODE_KEY",
    "PAYLOAD_KEY",
    "STATE_PREFIX",
    "TRAIN_KEY",
    "UPDATE_KEY",
    "WIRE_RECEIVED_KEY",
    "WIRE_SENT_KEY",
    "WIRE_SINCE_KEY",
    "CompressedUplink",
    "compression_mod",
    "downlink_from_record",
    "downlink_to_record",
    "load_client_state",
    "outcomes_from_record",
    "outcomes_to_record",
    "payload_from_record",
    "payload_to_record",
    "record_to_state",
    "reply_content",
    "reply_parts",
    "save_client_state",
    "set_reply_metric",
    "stamp_wire_counts",
    "state_to_record",
    "train_content",
    "train_parts",
]

#: Most rounds an outcomes record may describe (the server sends a node's latest few).
MAX_OUTCOMES = 64

#: Prefix of fedcomp's entries in a node's ``context.state``.
STATE_PREFIX = "fedcomp."

#: Key of the compressed update inside a reply's ConfigRecord.
PAYLOAD_KEY = "payload"

#: Key of the replica digest beside it.
DIGEST_KEY = "digest"

#: A train reply's one record (payload, digest and metrics), and the prefix of the
#: metrics' entries in it.
UPDATE_KEY, METRICS_PREFIX = "update", "metrics."

#: A query reply's record: the partition a node holds.
NODE_KEY = "node"

#: Metrics a warm ClientApp worker adds to a reply: the TCP bytes its SuperNode has
#: sent to and received from the SuperLink so far (:mod:`fedcomp.ops.netmeter`).
WIRE_SENT_KEY, WIRE_RECEIVED_KEY = "wire-sent-bytes", "wire-received-bytes"
#: ... and when its counting began (a restarted node counts from zero again).
WIRE_SINCE_KEY = "wire-counted-since"

#: A train message's one record, and the prefixes of the downlink's and the outcomes'
#: entries in it (run-config keys never contain a dot).
TRAIN_KEY, DOWNLINK_PREFIX, OUTCOMES_PREFIX = "train", "downlink.", "outcomes."


def state_to_record(state: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Wrap a feedback ``state_dict()`` as an ArrayRecord for ``context.state``."""
    return ArrayRecord({name: Array(np.ascontiguousarray(value))
                        for name, value in state.items()})


def record_to_state(record: ArrayRecord) -> dict[str, np.ndarray]:
    """Inverse of :func:`state_to_record`."""
    return {name: record[name].numpy() for name in record}


def payload_to_record(payload: bytes) -> ConfigRecord:
    """Put payload bytes in a ConfigRecord: 63 bytes of framing against 490 as an Array."""
    return ConfigRecord({PAYLOAD_KEY: payload})


def payload_from_record(record: ConfigRecord) -> bytes:
    """Extract payload bytes; a missing or non-bytes value raises ``ValueError``."""
    value = record.get(PAYLOAD_KEY)
    if not isinstance(value, bytes):
        raise ValueError(f"reply has no {PAYLOAD_KEY!r} bytes (got {type(value).__name__})")
    return value


def reply_content(payload: bytes, digest: str, metrics: Mapping[str, float]) -> RecordDict:
    """A train reply: the payload, the replica digest and the metrics in one record.

    Flower 1.42 moves every record of a message as its own signed HTTP request (about
    1 kB of headers each), so a reply carries one record, not a ``MetricRecord``
    beside it.
    """
    update = payload_to_record(payload)
    update[DIGEST_KEY] = digest
    for key, value in metrics.items():
        update[METRICS_PREFIX + key] = value
    return RecordDict({UPDATE_KEY: update})


def set_reply_metric(content: RecordDict, key: str, value: float) -> None:
    """Set one metric of a train reply made by :func:`reply_content`."""
    content[UPDATE_KEY][METRICS_PREFIX + key] = value


def stamp_wire_counts(content: RecordDict, sent: int, received: int, since: float) -> bool:
    """Add the node's wire counters to a reply's metrics (a train reply's, or a query
    reply's ``node`` record); False when the reply is neither.

    They go into a record the reply has anyway: a record of their own would be one
    more HTTP request.
    """
    counts = {WIRE_SENT_KEY: int(sent), WIRE_RECEIVED_KEY: int(received),
              WIRE_SINCE_KEY: float(since)}
    update = content[UPDATE_KEY] if UPDATE_KEY in content else None
    node = content[NODE_KEY] if NODE_KEY in content else None
    if isinstance(update, ConfigRecord):
        for key, value in counts.items():
            set_reply_metric(content, key, value)
    elif isinstance(node, MetricRecord):
        for key, value in counts.items():
            node[key] = value
    else:
        return False
    return True


def reply_parts(content: RecordDict) -> tuple[bytes, dict[str, Any], str]:
    """A train reply's payload bytes, raw metrics and replica digest.

    Raises :class:`~fedcomp.federated.replies.ReplyError` when the record is missing or
    of the wrong kind; the metrics' values are checked by
    :func:`~fedcomp.federated.replies.parse_reply_metrics`.
    """
    update = content[UPDATE_KEY] if UPDATE_KEY in content else None
    if not isinstance(update, ConfigRecord):
        raise ReplyError(f"reply lacks a ConfigRecord {UPDATE_KEY!r}")
    try:
        payload = payload_from_record(update)
    except ValueError as exc:
        raise ReplyError(str(exc)) from None
    metrics = {key[len(METRICS_PREFIX):]: value for key, value in update.items()
               if key.startswith(METRICS_PREFIX)}
    return payload, metrics, parse_digest(update.get(DIGEST_KEY))


def train_content(settings: Mapping[str, Any], downlink: DownlinkMessage,
                  outcomes: Mapping[int, bool]) -> RecordDict:
    """A train message: the run settings, the downlink and the node's recent outcomes
    in one record (one HTTP request in Flower 1.42 instead of three)."""
    record = ConfigRecord(dict(settings))
    for prefix, part in ((DOWNLINK_PREFIX, downlink_to_record(downlink)),
                         (OUTCOMES_PREFIX, outcomes_to_record(outcomes))):
        for key, value in part.items():
            record[prefix + key] = value
    return RecordDict({TRAIN_KEY: record})


def train_parts(content: RecordDict
                ) -> tuple[dict[str, Any], DownlinkMessage, dict[int, bool] | None]:
    """Inverse of :func:`train_content`: (settings, downlink, outcomes or None).

    A missing or malformed record raises ``ValueError``.
    """
    record = content[TRAIN_KEY] if TRAIN_KEY in content else None
    if not isinstance(record, ConfigRecord):
        raise ValueError(f"train message lacks a ConfigRecord {TRAIN_KEY!r}")
    settings: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {DOWNLINK_PREFIX: {}, OUTCOMES_PREFIX: {}}
    for key, value in record.items():
        prefix = next((p for p in parts if key.startswith(p)), None)
        if prefix is None:
            settings[key] = value
        else:
            parts[prefix][key[len(prefix):]] = value
    downlink = downlink_from_record(ConfigRecord(parts[DOWNLINK_PREFIX]))
    outcomes = (outcomes_from_record(ConfigRecord(parts[OUTCOMES_PREFIX]))
                if parts[OUTCOMES_PREFIX] else None)
    return settings, downlink, outcomes


def downlink_to_record(message: DownlinkMessage) -> ConfigRecord:
    """A downlink message as a ConfigRecord (payloads as a list of bytes)."""
    record = ConfigRecord({"kind": message.kind, "from-round": message.from_round,
                           "to-round": message.to_round})
    # Empty values are left out: Flower's ConfigRecord.count_bytes (message_size_mod)
    # fails on an empty string or list.
    if message.payloads:
        record["payloads"] = list(message.payloads)
    if message.base_digest:
        record["base-digest"] = message.base_digest
    return record


def downlink_from_record(record: ConfigRecord) -> DownlinkMessage:
    """Inverse of :func:`downlink_to_record`; a malformed record raises ``ValueError``."""
    payloads = record.get("payloads", [])
    kind, start, stop = record.get("kind"), record.get("from-round"), record.get("to-round")
    base_digest = record.get("base-digest", "")
    if (not isinstance(kind, str) or not isinstance(start, int) or not isinstance(stop, int)
            or not isinstance(base_digest, str) or not isinstance(payloads, list)
            or not all(isinstance(p, bytes) for p in payloads)):
        raise ValueError("malformed downlink record")
    return DownlinkMessage(kind, start, stop, tuple(payloads), base_digest)


def outcomes_to_record(outcomes: Mapping[int, bool]) -> ConfigRecord:
    """What the server says of a node's recent rounds: round -> update applied or not."""
    rounds = sorted(outcomes)[-MAX_OUTCOMES:]
    # Never an empty list: Flower's ConfigRecord.count_bytes fails on one.
    return ConfigRecord({"rounds": rounds or [-1],
                         "applied": [bool(outcomes[r]) for r in rounds] or [False]})


def outcomes_from_record(record: ConfigRecord) -> dict[int, bool]:
    """Inverse of :func:`outcomes_to_record`; a malformed record raises ``ValueError``."""
    rounds, applied = record.get("rounds"), record.get("applied")
    if (not isinstance(rounds, list) or not isinstance(applied, list)
            or len(rounds) != len(applied) or len(rounds) > MAX_OUTCOMES
            or not all(isinstance(r, int) and not isinstance(r, bool) for r in rounds)
            or not all(isinstance(a, bool) for a in applied)):
        raise ValueError("malformed uplink outcomes record")
    return {r: a for r, a in zip(rounds, applied, strict=True) if r >= 0}


def save_client_state(state: RecordDict, arrays: Mapping[str, Mapping[str, np.ndarray]]) -> None:
    """Store a client's state (groups of arrays) in ``context.state``."""
    for group, values in arrays.items():
        state[STATE_PREFIX + group] = state_to_record(values)


def load_client_state(state: RecordDict) -> dict[str, dict[str, np.ndarray]]:
    """Read back what :func:`save_client_state` stored (empty groups if none)."""
    return {key[len(STATE_PREFIX):]: record_to_state(record)
            for key, record in state.items()
            if key.startswith(STATE_PREFIX) and isinstance(record, ArrayRecord)}

