"""Server side of the uplink: validate, decode and average the clients' deltas.

Each reply is decoded strictly against the expected model and codec
(:func:`fedcomp.wire.unpack_payload`). A bad reply (corrupt, hostile, for another
round, with a nonsensical weight) is rejected on its own, with its reason, and the
round goes on with the others. The weighted mean is accumulated one reply at a time,
so memory stays at one model plus one decoded update whatever the number of
clients.

Optional norm bound, against poisoned or broken clients: an update whose L2 norm is
more than ``norm_bound`` times the median norm of the round's valid updates is
rejected (reason ``"norm"``) or clipped to that bound. It needs at least three valid
updates to have a meaningful median and then holds the round's decoded updates in
memory (clients per round x model size). Off by default.

Replies are summed in the order of their ``order_key`` (the client's partition id),
not their arrival order, so that the floating-point sum, and with it the whole run,
is reproducible.
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
from fedcomp.privacy.clipping import clip_update
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
    order_key: int = 0


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
    norms: dict[int, float] = field(default_factory=dict)
    clipped: list[int] = field(default_factory=list)
    #: Sum of the accepted updates (weighted; with ``clip_norm``: re-clipped, unweighted).
    total: dict[str, np.ndarray] | None = None

    @property
    def rejected_by_reason(self) -> dict[str, int]:
        return dict(Counter(r.reason for r in self.rejected))


def aggregate_deltas(
    replies: Iterable[ClientReply],
    expected: Mapping[str, ExpectedTensor],
    *,
    expected_meta: Mapping[str, Any] | None = None,
    norm_bound: float = 0.0,
    norm_action: str = "reject",
    clip_norm: float = 0.0,
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
    norm_bound
        0 (off), or the multiple of the median update norm above which an update is
        rejected or clipped (``norm_action``: ``"reject"`` or ``"clip"``).
    clip_norm
        0 (off), or differential privacy's clipping norm: every decoded update is
        re-clipped to it and all count equally, so each contributes at most
        ``clip_norm`` to ``result.total`` whatever its codec did.
    """
    if norm_action not in ("reject", "clip"):
        raise ValueError(f"norm_action must be 'reject' or 'clip', got {norm_action!r}")
    result = AggregationResult(mean_delta=None)
    start = time.perf_counter()
    valid = (item for item in (_decode(reply, expected, expected_meta, result)
                               for reply in sorted(replies, key=lambda r: (r.order_key,
                                                                           r.node_id)))
             if item is not None)
    if norm_bound > 0:
        valid = iter(_apply_norm_bound(list(valid), norm_bound, norm_action, result))
    total: dict[str, np.ndarray] | None = None
    weight_sum = 0.0
    for node, weight, tensors in valid:
        if clip_norm > 0:
            tensors, _ = clip_update(tensors, clip_norm)
            weight = 1.0
        if total is None:
            total = {name: np.zeros(spec.shape, dtype=np.float64)
                     for name, spec in expected.items()}
        for name, value in tensors.items():
            total[name] += weight * value
        weight_sum += weight
        result.accepted.append(node)
    if total is not None:
        result.total = {k: v.astype(np.float32) for k, v in total.items()}
        result.mean_delta = {k: (v / weight_sum).astype(np.float32) for k, v in total.items()}
    result.decode_s = time.perf_counter() - start
    return result


Decoded = tuple[int, float, dict[str, np.ndarray]]


def _reject(result: AggregationResult, node: int, reason: str, message: str) -> None:
    result.rejected.append(Rejection(node, reason, message))
    log.warning("rejected the update of node %s (%s): %s", node, reason, message)


def _decode(reply: ClientReply, expected: Mapping[str, ExpectedTensor],
            expected_meta: Mapping[str, Any] | None,
            result: AggregationResult) -> Decoded | None:
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
        _reject(result, reply.node_id, exc.reason, str(exc))
        return None
    return reply.node_id, weight, decoded.tensors


def _norm(tensors: Mapping[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.vdot(v, v)) for v in tensors.values()))


def _apply_norm_bound(items: list[Decoded], bound: float, action: str,
                      result: AggregationResult) -> list[Decoded]:
    norms = [_norm(tensors) for _, _, tensors in items]
    result.norms = {node: norm for (node, _, _), norm in zip(items, norms, strict=True)}
    if len(items) < 3:
        return items  # no meaningful median yet
    limit = bound * float(np.median(norms))
    kept = []
    for (node, weight, tensors), norm in zip(items, norms, strict=True):
        if norm <= limit:
            kept.append((node, weight, tensors))
        elif action == "clip":
            scale = np.float32(limit / norm)
            kept.append((node, weight, {k: v * scale for k, v in tensors.items()}))
            result.clipped.append(node)
        else:
            _reject(result, node, "norm", f"update norm {norm:.3g} is above {bound:g} x the "
                    f"round's median ({limit:.3g})")
    return kept
