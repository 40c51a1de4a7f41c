"""Server side of the uplink: validate, decode and average the clients' deltas.

Each reply is decoded strictly against the expected model and codec
(:func:`fedcomp.codecs.wire.unpack_payload`). A bad reply (corrupt, hostile, for another
round, with a nonsensical weight) is rejected on its own, with its reason, and the
round goes on with the others. Without bounds the weighted mean is accumulated one
reply at a time, so memory stays at one model plus one decoded update whatever the
number of clients; it is summed in float64, so values near the float32 maximum
cannot overflow the sum.

Bounds on one client's influence, against poisoned or broken clients (the run's
defaults turn the first two on: :class:`fedcomp.config.RunConfig`):

* a norm bound: an update whose L2 norm is more than ``norm_bound`` times the median
  norm of the round's valid updates (or an earlier round's, when this one has fewer
  than three) is clipped to that bound or rejected (reason ``"norm"``);
* a weight cap: a claimed example count above ``weight_cap`` times the round's median
  claim is cut down to it;
* a robust rule instead of the mean (:mod:`fedcomp.federated.robust`): coordinate-wise median,
  trimmed mean, (multi-)Krum.

Each of them holds the round's decoded updates in memory (clients per round x model
size).

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

from fedcomp.codecs.budget import topk_count, value_bits
from fedcomp.codecs.wire import ExpectedTensor, unpack_payload
from fedcomp.errors import PayloadError
from fedcomp.federated.replies import MAX_EXAMPLES
from fedcomp.federated.robust import AggregationRule
from fedcomp.privacy.clipping import clip_update

__all__ = ["AggregationResult", "ClientReply", "Rejection", "aggregate_deltas"]

log = logging.getLogger(__name__)

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
    #: The round's median update norm (with a norm bound and enough updates).
    median_norm: float | None = None
    #: Nodes whose claimed example count was cut down to the cap.
    weight_capped: list[int] = field(default_factory=list)
    #: The aggregate was not finite in float32 and was dropped.
    non_finite: bool = False
    #: Per decoded node, the Top-K count and the bits per kept value of each tensor
    #: coded within a byte budget (read from the payload's own specs; empty without a
    #: budget).
    kept: dict[int, dict[str, tuple[int, float]]] = field(default_factory=dict)

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
    reference_norm: float | None = None,
    weight_cap: float = 0.0,
    rule: AggregationRule | None = None,
) -> AggregationResult:
    """Example-weighted mean (or a robust rule) of the valid replies' decoded deltas.

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
        rejected or clipped (``norm_action``: ``"reject"`` or ``"clip"``). The median
        is the round's with at least :data:`MIN_FOR_MEDIAN` valid updates, else
        ``reference_norm`` (an earlier round's), else there is no bound yet.
    clip_norm
        0 (off), or differential privacy's clipping norm: every decoded update is
        re-clipped to it and all count equally, so each contributes at most
        ``clip_norm`` to ``result.total`` whatever its codec did.
    weight_cap
        0 (off), or the multiple of the round's median claimed example count above
        which a claim is cut down (with at least :data:`MIN_FOR_MEDIAN` valid updates):
        one client claiming a billion examples cannot take over the mean.
    rule
        ``None`` or ``mean``: the weighted mean, accumulated one update at a time;
        a robust rule (:mod:`fedcomp.federated.robust`) holds the round's updates at once.

    The sum is accumulated in float64. A decoded update with a non-finite value is
    rejected (``non-finite``); a mean that is not finite in float32 (values near the
    float32 maximum) is not returned: ``result.mean_delta`` is None and
    ``result.non_finite`` is set, so the caller skips the round.
    """
    if norm_action not in ("reject", "clip"):
        raise ValueError(f"norm_action must be 'reject' or 'clip', got {norm_action!r}")
    result = AggregationResult(mean_delta=None)
    start = time.perf_counter()
    valid = (item for item in (_decode(reply, expected, expected_meta, result)
                               for reply in sorted(replies, key=lambda r: (r.order_key,
                                                                           r.node_id)))
             if item is not None)
    robust = rule is not None and rule.robust
    if norm_bound > 0 or weight_cap > 0 or robust:
        items = list(valid)
        if weight_cap > 0:
            items = _cap_weights(items, weight_cap, result)
        if norm_bound > 0:
            items = _apply_norm_bound(items, norm_bound, norm_action, reference_norm, result)
        valid = iter(items)
    if robust:
        _combine_robust(list(valid), rule, clip_norm, expected, result)
    else:
        _weighted_mean(valid, clip_norm, expected, result)
    if result.mean_delta is not None and not all(
            np.isfinite(v).all() for part in (result.mean_delta, result.total or {})
            for v in part.values()):
        result.mean_delta, result.total, result.non_finite = None, None, True
        log.warning("the aggregate of %d updates is not finite in float32: not used",
                    len(result.accepted))
    result.decode_s = time.perf_counter() - start
    return result


#: Valid updates a round needs before its median norm or weight means anything.
MIN_FOR_MEDIAN = 3


def _weighted_mean(valid: Iterable[Decoded], clip_norm: float,
                   expected: Mapping[str, ExpectedTensor], result: AggregationResult) -> None:
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
            total[name] += weight * value.astype(np.float64)
        weight_sum += weight
        result.accepted.append(node)
    if total is not None:
        with np.errstate(over="ignore"):  # a float32 overflow is caught by the caller
            result.total = {k: v.astype(np.float32) for k, v in total.items()}
            result.mean_delta = {k: (v / weight_sum).astype(np.float32)
                                 for k, v in total.items()}


def _combine_robust(items: list[Decoded], rule: AggregationRule, clip_norm: float,
                    expected: Mapping[str, ExpectedTensor], result: AggregationResult) -> None:
    if not items:
        return
    updates = [clip_update(t, clip_norm)[0] if clip_norm > 0 else t for _, _, t in items]
    combined = rule.combine(updates)
    result.accepted.extend(node for node, _, _ in items)
    with np.errstate(over="ignore"):
        result.mean_delta = {k: combined[k].astype(np.float32) for k in expected}
        result.total = {k: (combined[k] * len(items)).astype(np.float32) for k in expected}


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
        for name, value in decoded.tensors.items():
            if not np.isfinite(value).all():
                raise PayloadError(f"tensor {name!r} decodes to NaN or Inf",
                                   reason="non-finite")
    except PayloadError as exc:
        _reject(result, reply.node_id, exc.reason, str(exc))
        return None
    kept = {name: (int(topk_count(pipeline, math.prod(spec.shape)) or 0), value_bits(pipeline))
            if (pipeline := decoded.pipelines.get(name)) is not None else (0, 0.0)
            for name, spec in expected.items() if spec.family is not None}
    if kept:
        result.kept[reply.node_id] = kept
    return reply.node_id, weight, decoded.tensors


def _norm(tensors: Mapping[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.vdot(v.astype(np.float64), v.astype(np.float64)))
                         for v in tensors.values()))


def _cap_weights(items: list[Decoded], cap: float, result: AggregationResult) -> list[Decoded]:
    if len(items) < MIN_FOR_MEDIAN:
        return items
    limit = cap * float(np.median([weight for _, weight, _ in items]))
    capped = []
    for node, weight, tensors in items:
        if weight > limit:
            result.weight_capped.append(node)
            log.warning("node %s claims %g examples, above %g x the round's median: "
                        "counted as %g", node, weight, cap, limit)
            weight = limit
        capped.append((node, weight, tensors))
    return capped


def _apply_norm_bound(items: list[Decoded], bound: float, action: str,
                      reference: float | None, result: AggregationResult) -> list[Decoded]:
    norms = [_norm(tensors) for _, _, tensors in items]
    result.norms = {node: norm for (node, _, _), norm in zip(items, norms, strict=True)}
    if len(items) >= MIN_FOR_MEDIAN:
        result.median_norm = float(np.median(norms))
        median = result.median_norm
    elif reference is not None and reference > 0:
        median = reference  # too few updates for a median of their own
    else:
        return items  # no meaningful median yet
    limit = bound * median
    kept = []
    for (node, weight, tensors), norm in zip(items, norms, strict=True):
        if norm <= limit:
            kept.append((node, weight, tensors))
        elif action == "clip":
            scale = limit / norm
            kept.append((node, weight, {k: (v.astype(np.float64) * scale).astype(np.float32)
                                        for k, v in tensors.items()}))
            result.clipped.append(node)
        else:
            _reject(result, node, "norm", f"update norm {norm:.3g} is above {bound:g} x the "
                    f"round's median ({limit:.3g})")
    return kept
