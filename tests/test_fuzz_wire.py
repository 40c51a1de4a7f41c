"""Fuzzing the decoder: thousands of hostile payloads, one error type, bounded memory."""

from __future__ import annotations

import collections
import itertools
import tracemalloc

import numpy as np

from fedcomp.codecs.fuzzing import MUTATIONS, mutate
from fedcomp.codecs.policy import CompressionPolicy, encode_update
from fedcomp.codecs.wire import unpack_payload
from fedcomp.errors import PayloadError

SHAPES = {"conv.weight": (32, 1, 3, 3), "conv.bias": (32,), "fc.weight": (10, 2048),
          "fc.bias": (10,)}
POLICIES = [
    CompressionPolicy(codec=spec, small_codec=small, min_numel=100)
    for spec, small in [
        ("topk:ratio=0.01|quant:bits=4", "none"),
        ("topk:ratio=0.05|quant:bits=3|zstd:level=1", "fp16"),
        ("topk:ratio=0.4", "bf16"),               # bitmap indices
        ("randk:ratio=0.02|qsgd:levels=4", "none"),
        ("topk:ratio=0.001|ternary:mode=mean", "none"),
        ("sign", "none"),
        ("lowrank:rank=2|fp16", "none"),
        ("threshold:value=1.5", "none"),
        ("quant:bits=8,chunk=64|zstd", "none"),
        ("none", "none"),
        ("topk:ratio=0.05|ternary:mode=mean", "none"),  # rows index coding (scaled rows)
    ]
]
#: Policies whose input rows get very different scales, so Top-K codes its indices
#: by rows (the last policy above).
ROW_SCALED = {len(POLICIES) - 1}
CASES_PER_POLICY = 150  # 1,650 hostile payloads in all


def _row_scaled(tensor: np.ndarray) -> np.ndarray:
    if tensor.ndim < 2:
        return tensor
    scales = np.logspace(0, 3, tensor.shape[0], dtype=np.float32)
    return tensor * scales.reshape((-1,) + (1,) * (tensor.ndim - 1))


def test_hostile_payloads_raise_only_payload_error_and_stay_in_bounded_memory():
    rng = np.random.default_rng(2026)
    model_bytes = 4 * sum(int(np.prod(s)) for s in SHAPES.values())
    reasons: collections.Counter = collections.Counter()
    kinds: collections.Counter = collections.Counter()
    tracemalloc.start()
    try:
        for index, policy in enumerate(POLICIES):
            tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
            if index in ROW_SCALED:
                tensors = {n: _row_scaled(t) for n, t in tensors.items()}
            payload = encode_update(tensors, policy, rng=rng, meta={"round": 1}).payload
            expected = policy.expected(SHAPES)
            for case in range(CASES_PER_POLICY):
                kind, hostile = mutate(payload, rng)
                kinds[kind] += 1
                tracemalloc.reset_peak()
                try:
                    # Most cases against the expected model; some with none, as a
                    # receiver that has not been told what to expect.
                    decoded = unpack_payload(
                        hostile,
                        expected=expected if case % 5 else None,
                        max_total_numel=10 * sum(int(np.prod(s)) for s in SHAPES.values()),
                    )
                except PayloadError as exc:
                    reasons[exc.reason] += 1
                    assert str(exc), "every rejection says what was wrong"
                else:
                    reasons["accepted"] += 1
                    for value in decoded.tensors.values():
                        assert value.dtype == np.float32 and np.isfinite(value).all()
                # Decoding never allocates much more than the model it decodes to.
                assert tracemalloc.get_traced_memory()[1] < 40 * model_bytes + (8 << 20)
    finally:
        tracemalloc.stop()
    assert sum(kinds.values()) >= 1000
    assert set(kinds) == set(MUTATIONS)
    # The structure-aware mutations reach the checks behind the checksum.
    assert {"checksum", "header", "size", "truncated"} <= set(reasons)
    assert len(set(reasons) - {"accepted", "checksum"}) >= 6, reasons
    # "invalid" is the decoder's catch-all for a check it lacks: none may be missing.
    assert "invalid" not in reasons, reasons


def test_hostile_budgeted_payloads_raise_only_payload_error():
    """A byte budget's payloads: members of each tensor's family, in several value
    codings, some tensors left out. Their mutations decode against the families or
    are rejected with a reason, never with another error; a decoded payload has every
    expected tensor (zeros for those it leaves out), finite and of its shape. Both
    header forms: JSON against the layout dictionary, and predicted."""
    from fedcomp.codecs.budget import VALUE_CHOICES
    from fedcomp.codecs.policy import encode_within_budget

    rng = np.random.default_rng(7)
    numel = sum(int(np.prod(s)) for s in SHAPES.values())
    reasons: collections.Counter = collections.Counter()
    left_out = 0
    forms: collections.Counter = collections.Counter()
    for budget, wire_header in itertools.product(
            (4 * numel // 30, 4 * numel // 300, 4 * numel // 1000), ("json", "predicted")):
        policy = CompressionPolicy("topk:ratio=0.01|ternary:mode=mean", budgeted=True,
                                   budget_values=VALUE_CHOICES, wire_header=wire_header)
        expected = policy.expected(SHAPES)
        tensors = {n: _row_scaled(rng.standard_normal(s).astype(np.float32))
                   for n, s in SHAPES.items()}
        update = encode_within_budget(tensors, policy, budget, rng=rng, meta={"round": 1})
        left_out += sum(c.count == 0 for c in update.choices.values())
        forms[update.payload[5]] += 1
        for _ in range(200):
            _, hostile = mutate(update.payload, rng, expected)
            try:
                decoded = unpack_payload(hostile, expected=expected, max_total_numel=10 * numel)
            except PayloadError as exc:
                reasons[exc.reason] += 1
            else:
                reasons["accepted"] += 1
                assert set(decoded.tensors) == set(SHAPES)
                for name, value in decoded.tensors.items():
                    assert value.shape == SHAPES[name] and value.dtype == np.float32
                    assert np.isfinite(value).all()
    assert left_out > 0  # the smallest budget leaves some tensor out
    assert forms[4] == 3, forms  # every predicted policy's payload is predicted
    assert "invalid" not in reasons and len(set(reasons) - {"accepted"}) >= 4, reasons
