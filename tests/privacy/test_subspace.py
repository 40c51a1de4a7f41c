"""The shared random subspace: public positions, exact project/lift, noise on k coordinates."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedcomp.codecs.feedback import ErrorFeedback, NoFeedback
from fedcomp.config import RunConfig
from fedcomp.federated.aggregation import ClientReply, aggregate_deltas
from fedcomp.federated.client_round import encode_delta
from fedcomp.privacy import RandomSubspace, update_norm
from fedcomp.privacy.server import ServerPrivacy

SHAPES = {"fc.weight": (64, 100), "conv.weight": (8, 4, 3, 3), "fc.bias": (64,)}


def _update(seed: int, scale: float = 1.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (scale * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}


@given(ratio=st.floats(0.001, 1.0), seed=st.integers(0, 2**31), round_=st.integers(1, 10**6))
def test_project_then_lift_keeps_exactly_the_subspace(ratio, seed, round_):
    subspace = RandomSubspace(ratio, seed, round_, min_numel=500)
    update = _update(seed % 1000)
    compact = subspace.project(update)
    assert {k: v.shape for k, v in compact.items()} == subspace.compact_shapes(SHAPES)
    lifted = subspace.lift(compact, SHAPES)
    masks = subspace.masks(SHAPES)
    for name, value in update.items():
        np.testing.assert_array_equal(lifted[name][masks[name]], value[masks[name]])
        assert not lifted[name][~masks[name]].any()
        assert masks[name].sum() == subspace.count(value.size)
    assert masks["fc.bias"].all()  # under min_numel: whole


def test_positions_are_public_the_same_for_every_client_and_change_every_round():
    a = RandomSubspace(0.05, seed=7, server_round=3)
    b = RandomSubspace(0.05, seed=7, server_round=3)
    np.testing.assert_array_equal(a.positions("fc.weight", 6400), b.positions("fc.weight", 6400))
    other_round = RandomSubspace(0.05, seed=7, server_round=4).positions("fc.weight", 6400)
    assert not np.array_equal(a.positions("fc.weight", 6400), other_round)
    # Two tensors of one size get their own positions (the name is mixed in).
    assert not np.array_equal(a.positions("fc.weight", 6400), a.positions("other", 6400))


def test_a_shared_randk_payload_carries_no_index_bytes():
    cfg = RunConfig(shared_randk=0.1, codec="none", feedback="none", min_numel=500)
    shapes = SHAPES
    update, _ = encode_delta(cfg, NoFeedback(), _update(0), server_round=1, clip_norm=1.0,
                             rng=np.random.default_rng(0), shapes=shapes)
    values = sum(np.prod(s) for s in cfg.subspace(1).compact_shapes(shapes).values())
    assert 4 * values <= len(update.payload) < 4 * values + 200  # values plus the header


def test_clients_send_the_subspace_and_the_server_noises_only_there():
    cfg = RunConfig(dp="client", shared_randk=0.05, codec="quant:bits=8", min_numel=500,
                    clients_per_round=5, dp_clip_norm=1.0, dp_noise_multiplier=1.0)
    subspace = cfg.subspace(1)
    expected = cfg.uplink_expected(SHAPES)
    replies = []
    for node in range(5):
        update, metrics = encode_delta(cfg, ErrorFeedback("x"), _update(node, scale=3.0),
                                       server_round=1, clip_norm=1.0,
                                       rng=np.random.default_rng(node), shapes=SHAPES)
        assert metrics == {"dp-unclipped": 0.0}  # norm far above 1: clipped
        replies.append(ClientReply(node, update.payload, 1.0, order_key=node))
    result = aggregate_deltas(replies, expected, expected_meta={"round": 1}, clip_norm=1.0)
    assert len(result.accepted) == 5
    privacy = ServerPrivacy(cfg)
    privacy.sample(list(range(50)))  # q = 0.1, 5 expected
    compact_shapes = {k: v.shape for k, v in expected.items()}
    mean = subspace.lift(privacy.release(result, compact_shapes, {}), SHAPES)
    masks = subspace.masks(SHAPES)
    for name in SHAPES:
        assert not mean[name][~masks[name]].any()  # no noise off the subspace
    # The noise norm grows with sqrt(k), not sqrt(d): sigma C sqrt(k) / expected.
    k = sum(int(m.sum()) for m in masks.values())
    d = sum(int(np.prod(s)) for s in SHAPES.values())
    noise_only = privacy.release(AggregationResultZero(compact_shapes), compact_shapes, {})
    assert update_norm(noise_only) == pytest.approx(np.sqrt(k) / 5, rel=0.15)
    assert update_norm(noise_only) < 0.5 * np.sqrt(d) / 5


class AggregationResultZero:
    """A round whose clipped sum is exactly zero (to look at the noise alone)."""

    def __init__(self, shapes):
        self.total = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
        self.accepted: list[int] = []
        self.mean_delta = None


def test_error_feedback_keeps_the_rest_of_the_subspace_for_later():
    """Without clipping nothing is lost: inputs = what the server decoded + residual."""
    cfg = RunConfig(shared_randk=0.2, codec="quant:bits=8", min_numel=500)
    memory = ErrorFeedback("x")
    inputs = {k: np.zeros(s, np.float64) for k, s in SHAPES.items()}
    received = {k: np.zeros(s, np.float64) for k, s in SHAPES.items()}
    for round_ in range(1, 6):
        delta = _update(round_)
        update, _ = encode_delta(cfg, memory, delta, server_round=round_, clip_norm=1.0,
                                 rng=np.random.default_rng(round_), shapes=SHAPES)
        decoded = aggregate_deltas([ClientReply(0, update.payload, 1.0)],
                                   cfg.uplink_expected(SHAPES)).mean_delta
        lifted = cfg.subspace(round_).lift(decoded, SHAPES)
        for k in SHAPES:
            inputs[k] += delta[k]
            received[k] += lifted[k]
    for k in SHAPES:
        np.testing.assert_allclose(inputs[k], received[k] + memory.memory[k], atol=1e-4)
