"""Server side of the uplink: validate, decode and average the clients' deltas.

Each reply is decoded strictly against the expected model and codec
(:func:`fedcomp.wire.unpack_payload`). A bad reply (corrupt, hostile, for another
round, with a nonsensical weight) is rejected on its own, with its reason, and the
round goes on with the others. The weighted mean is accumulated one reply at a time,
so memory stays at one model plus one decoded update whatever the number of
clients.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedcomp.errors import PayloadError
from fedcomp.wire import ExpectedTensor, unpack_payload

__all__ = ["AggregationResult", "ClientReply", "Rejection", "aggregate_deltas"]

log = logging.getLogger(__name__)

#: Largest example count a client may claim (its weight in the mean).
MAX_EXAMPLES = 1e9


@dataclass(frozen=True)
class ClientReply:
    """One client's answer: the payload bytes and the weight it claims."""

    node_id: int
    payload: bytes
    num_examples: float


@dataclass(frozen=True)
class Rejection:
    node_id: int
    reason: str
    message: str


@dataclass
class AggregationResult:
    """The weighted mean delta (``None`` if nothing was accepted) and what happened."""

    mean_delta: dict[str, np.ndarray] | None
    accepted: list[int] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    decode_s: float = 0.0
    received_bytes: int = 0

    @property
    def rejected_by_reason(self) -> dict[str, int]:
        return dict(Counter(r.reason for r in self.rejected))


def aggregate_deltas(
    replies: Iterable[ClientReply],
    expected: Mapping[str, ExpectedTensor],
    *,
    expected_meta: Mapping[str, Any] | None = None,
) -> AggregationResult:
    """Example-weighted mean of the valid replies' decoded deltas.

    Parameters
    ----------
    replies
        The round's replies.
    expected
        Tensor names, shapes and pipelines every payload must match.
    expected_meta
        Payload meta values that must match (e.g. ``{"round": 7}``): an update made
        for another round or model version is rejected as ``"stale"``.
    """
    result = AggregationResult(mean_delta=None)
    total: dict[str, np.ndarray] | None = None
    weight_sum = 0.0
    start = time.perf_counter()
    for reply in replies:
        result.received_bytes += len(reply.payload)
        try:
            weight = float(reply.num_examples)
            if not math.isfinite(weight) or not 0 < weight <= MAX_EXAMPLES:
                raise PayloadError(f"num-examples {reply.num_examples!r} is not in "
                                   f"(0, {MAX_EXAMPLES:g}]", reason="weight")
            decoded = unpack_payload(reply.payload, expected=expected)
            for key, value in (expected_meta or {}).items():
                if decoded.meta.get(key) != value:
                    raise PayloadError(f"payload {key} is {decoded.meta.get(key)!r}, "
                                       f"expected {value!r}", reason="stale")
        except PayloadError as exc:
            result.rejected.append(Rejection(reply.node_id, exc.reason, str(exc)))
            log.warning("rejected the update of node %s (%s): %s", reply.node_id,
                        exc.reason, exc)
            continue
        if total is None:
            total = {name: np.zeros(spec.shape, dtype=np.float64)
                     for name, spec in expected.items()}
        for name, value in decoded.tensors.items():
            total[name] += weight * value
        weight_sum += weight
        result.accepted.append(reply.node_id)
    if total is not None:
        result.mean_delta = {k: (v / weight_sum).astype(np.float32) for k, v in total.items()}
    result.decode_s = time.perf_counter() - start
    return result
