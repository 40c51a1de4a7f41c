"""Everything a client sends besides its payload, parsed strictly.

A reply's metrics, counts, ids and DP fields come over the network: as untrusted as
the payload, which :func:`fedcomp.codecs.wire.unpack_payload` decodes strictly. Before this
module, one reply whose ``partition-id`` was NaN, whose ``num-examples`` was a list, or
whose ``dp-sample-rate`` was NaN (an accountant that never returned) could stop the
server. :func:`parse_reply_metrics` checks every known field for type, finiteness and
range, and raises :class:`ReplyError` naming the field: the strategy rejects that one
reply (reason ``metrics``) and the round goes on. Unknown fields are dropped, never
recorded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedcomp.federated.sampling import MAX_PARTITION_ID

__all__ = ["MAX_DIGEST_LENGTH", "MAX_EXAMPLES", "REPLY_FIELDS", "ReplyError", "parse_digest",
           "parse_reply_metrics"]

#: Largest example count a client may claim at all (its weight in the mean is capped
#: further, relative to the round's median: :func:`fedcomp.federated.aggregation.aggregate_deltas`).
MAX_EXAMPLES = 1e9
#: Longest replica digest accepted (a SHA-256 hex digest is 64 characters).
MAX_DIGEST_LENGTH = 128


class ReplyError(ValueError):
    """A field of a reply is missing, of the wrong type, non-finite or out of range."""

    reason = "metrics"


@dataclass(frozen=True)
class _Field:
    low: float
    high: float
    integral: bool = False
    low_open: bool = False


#: Every metric a fedcomp client may send, with the values it may take.
REPLY_FIELDS: dict[str, _Field] = {
    "partition-id": _Field(0, MAX_PARTITION_ID, integral=True),
    "num-examples": _Field(0, MAX_EXAMPLES, low_open=True),
    "train-loss": _Field(0, 1e6),
    "train-s": _Field(0, 1e6),
    "encode-s": _Field(0, 1e6),
    "downlink-decode-s": _Field(0, 1e6),
    "payload-bytes": _Field(0, 2.0 ** 40, integral=True),
    "downlink-bytes": _Field(0, 2.0 ** 40, integral=True),
    "replica-round": _Field(-1, 2.0 ** 31, integral=True),
    "residual-norm-in": _Field(0, 1e300),
    "given-back-norm": _Field(0, 1e300),
    "delta-norm": _Field(0, 1e300),
    "state-from-file": _Field(0, 1, integral=True),
    "dp-unclipped": _Field(0, 1, integral=True),
    "dp-sample-rate": _Field(0, 1, low_open=True),
    "dp-steps": _Field(0, 1e7, integral=True),
    # A deployed node's TCP bytes to and from the SuperLink so far (fedcomp.ops.netmeter).
    "wire-sent-bytes": _Field(0, 2.0 ** 53, integral=True),
    "wire-received-bytes": _Field(0, 2.0 ** 53, integral=True),
    "wire-counted-since": _Field(0, 1e11),
}


def _number(name: str, value: Any, field: _Field) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(
            value, (int, float, np.integer, np.floating)):
        raise ReplyError(f"reply field {name!r} must be a number, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise ReplyError(f"reply field {name!r} is {number}")
    if field.integral and number != int(number):
        raise ReplyError(f"reply field {name!r} must be a whole number, got {number!r}")
    below = number <= field.low if field.low_open else number < field.low
    if below or number > field.high:
        bracket = "(" if field.low_open else "["
        raise ReplyError(f"reply field {name!r} = {number!r} is outside "
                         f"{bracket}{field.low:g}, {field.high:g}]")
    return number


def parse_reply_metrics(raw: Mapping[str, Any], *, required: tuple[str, ...] = ()
                        ) -> dict[str, float]:
    """The known fields of a reply's metrics, checked; unknown ones dropped.

    Raises
    ------
    ReplyError
        If a field in ``required`` is missing, or any known field has a value it may
        not take (a list, a bool, NaN, infinity, a fraction where a count belongs, a
        value out of range).
    """
    if not isinstance(raw, Mapping):
        raise ReplyError(f"reply metrics must be a record, got {type(raw).__name__}")
    missing = [name for name in required if name not in raw]
    if missing:
        raise ReplyError(f"reply lacks {', '.join(map(repr, missing))}")
    return {name: _number(name, raw[name], REPLY_FIELDS[name])
            for name in REPLY_FIELDS if name in raw}


def parse_digest(value: Any) -> str:
    """A replica digest: a short string (its value is compared, never interpreted)."""
    if not isinstance(value, str) or len(value) > MAX_DIGEST_LENGTH:
        raise ReplyError(f"replica digest must be a string of at most {MAX_DIGEST_LENGTH} "
                         "characters")
    return value
