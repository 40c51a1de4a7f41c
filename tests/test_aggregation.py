"""Uplink aggregation: exact weighted mean, and each bad reply rejected on its own."""

from __future__ import annotations

import numpy as np
import pytest

from fedcomp.codecs.policy import CompressionPolicy, encode_update
from fedcomp.federated.aggregation import ClientReply, aggregate_deltas

SHAPES = {"w": (10, 20), "b": (10,)}
POLICY = CompressionPolicy("none")


def _reply(node, value, weight, round_=1, policy=POLICY):
    tensors = {k: np.full(s, value, np.float32) for k, s in SHAPES.items()}
    payload = encode_update(tensors, policy, rng=np.random.default_rng(node),
                            meta={"round": round_}).payload
    return ClientReply(node, payload, weight)


def test_weighted_mean_is_exact():
    result = aggregate_deltas([_reply(1, 1.0, 10), _reply(2, 4.0, 30)],
                              POLICY.expected(SHAPES), expected_meta={"round": 1})
    assert result.accepted == [1, 2] and not result.rejected
    np.testing.assert_allclose(result.mean_delta["w"], (10 * 1 + 30 * 4) / 40)
    assert result.received_bytes == sum(len(_reply(i, 0, 1).payload) for i in (1, 2))


def test_each_bad_reply_is_rejected_with_its_reason_and_the_rest_is_averaged():
    good = _reply(1, 2.0, 5)
    corrupt = bytearray(_reply(2, 9.0, 5).payload)
    corrupt[-10] ^= 0xFF
    replies = [
        good,
        ClientReply(2, bytes(corrupt), 5),
        _reply(3, 9.0, 5, round_=0),                      # stale: made for round 0
        _reply(4, 9.0, float("nan")),                     # nonsense weight
        _reply(5, 9.0, 5, policy=CompressionPolicy("fp16", min_numel=0)),  # another codec
        ClientReply(6, b"", 5),
    ]
    result = aggregate_deltas(replies, POLICY.expected(SHAPES), expected_meta={"round": 1})
    assert result.accepted == [1]
    assert result.rejected_by_reason == {"checksum": 1, "stale": 1, "weight": 1,
                                         "codec": 1, "truncated": 1}
    np.testing.assert_array_equal(result.mean_delta["b"], np.full(10, 2.0, np.float32))


def test_nothing_accepted_gives_no_mean():
    result = aggregate_deltas([ClientReply(1, b"junk", 1)], POLICY.expected(SHAPES))
    assert result.mean_delta is None and len(result.rejected) == 1
    with pytest.raises(AssertionError):
        assert result.accepted


def _scaled(node, scale):
    rng = np.random.default_rng(node)
    tensors = {k: (scale * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}
    return ClientReply(node, encode_update(tensors, POLICY, rng=rng).payload, 10, order_key=node)


def test_norm_bound_rejects_or_clips_a_poisoned_update_and_spares_clean_ones():
    replies = [_scaled(i, 1.0) for i in range(5)] + [_scaled(9, 1e6)]
    expected = POLICY.expected(SHAPES)
    plain = aggregate_deltas(replies, expected)
    assert plain.accepted == [0, 1, 2, 3, 4, 9]  # off by default: the poison gets in
    assert np.abs(plain.mean_delta["w"]).max() > 1e4

    rejected = aggregate_deltas(replies, expected, norm_bound=3.0)
    assert rejected.accepted == [0, 1, 2, 3, 4]
    assert rejected.rejected_by_reason == {"norm": 1}
    np.testing.assert_allclose(
        rejected.mean_delta["w"], aggregate_deltas(replies[:5], expected).mean_delta["w"])

    clipped = aggregate_deltas(replies, expected, norm_bound=3.0, norm_action="clip")
    assert clipped.clipped == [9] and len(clipped.accepted) == 6
    median = float(np.median(list(clipped.norms.values())))
    assert np.abs(clipped.mean_delta["w"]).max() < 3.0 * median

    clean = aggregate_deltas(replies[:5], expected, norm_bound=3.0)
    assert clean.accepted == [0, 1, 2, 3, 4] and not clean.rejected


def test_the_sum_does_not_depend_on_arrival_order():
    replies = [_scaled(i, 1.0 + i) for i in range(6)]
    expected = POLICY.expected(SHAPES)
    forward = aggregate_deltas(replies, expected).mean_delta
    backward = aggregate_deltas(replies[::-1], expected).mean_delta
    for name in SHAPES:
        np.testing.assert_array_equal(forward[name], backward[name])


@pytest.mark.parametrize("action", ["reject", "clip"])
def test_the_norm_bound_and_dp_clipping_together_bound_every_contribution(action):
    """The norm bound acts first (on the round's median), then DP re-clips every update.

    Values 1, 1.1, 0.9 and a poisoned 100 (norms about 14.5 per unit value): with the
    bound at 3 x median the poisoned update is dropped or scaled to the limit; DP then
    clips every kept update to C = 0.5, weight 1 each, so the sum is exactly 0.5 per
    kept update along the all-ones direction.
    """
    replies = [_reply(1, 1.0, 10), _reply(2, 1.1, 30), _reply(3, 0.9, 20),
               _reply(4, 100.0, 40)]
    result = aggregate_deltas(replies, POLICY.expected(SHAPES), norm_bound=3.0,
                              norm_action=action, clip_norm=0.5)
    kept = [1, 2, 3] if action == "reject" else [1, 2, 3, 4]
    assert result.accepted == kept
    assert [r.node_id for r in result.rejected] == ([4] if action == "reject" else [])
    numel = sum(int(np.prod(s)) for s in SHAPES.values())
    per_value = 0.5 / np.sqrt(numel)  # one clipped all-equal update, per coordinate
    np.testing.assert_allclose(result.total["w"], len(kept) * per_value, rtol=1e-5)
    np.testing.assert_allclose(result.mean_delta["b"], per_value, rtol=1e-5)


# ------------------------------------------------------------------ hostile updates
def _payload(values: dict, round_: int = 1) -> bytes:
    from fedcomp.codecs.policy import CompressionPolicy

    return encode_update(values, CompressionPolicy("none"), rng=np.random.default_rng(0),
                         meta={"round": round_}).payload


def test_replies_at_the_float32_maximum_never_make_a_non_finite_aggregate():
    from fedcomp.codecs.policy import CompressionPolicy

    shapes = {"w": (4, 5)}
    big = {"w": np.full((4, 5), np.finfo(np.float32).max, np.float32)}
    replies = [ClientReply(1, _payload(big), 10.0), ClientReply(2, _payload(big), 10.0)]
    result = aggregate_deltas(replies, CompressionPolicy("none").expected(shapes))
    # The float64 sum is finite, not in float32: the caller gets nothing to publish.
    assert result.non_finite and result.mean_delta is None and result.total is None
    # One such update among honest ones is clipped by the default norm bound, measured
    # against the model's own norm when there is no median yet.
    honest = {"w": np.ones((4, 5), np.float32)}
    bounded = aggregate_deltas([ClientReply(1, _payload(honest), 10.0),
                                ClientReply(2, _payload(big), 10.0)],
                               CompressionPolicy("none").expected(shapes), norm_bound=3.0,
                               norm_action="clip", reference_norm=10.0)
    assert bounded.clipped == [2] and np.isfinite(bounded.mean_delta["w"]).all()
    assert np.linalg.norm(bounded.mean_delta["w"]) <= (np.sqrt(20) + 30) / 2 * (1 + 1e-5)


def test_with_too_few_updates_the_norm_bound_uses_an_earlier_rounds_median():
    from fedcomp.codecs.policy import CompressionPolicy

    shapes = {"w": (4, 5)}
    honest = {"w": np.ones((4, 5), np.float32)}
    poison = {"w": np.full((4, 5), 1e6, np.float32)}
    replies = [ClientReply(1, _payload(honest), 1.0), ClientReply(2, _payload(poison), 1.0)]
    expected = CompressionPolicy("none").expected(shapes)
    unbounded = aggregate_deltas(replies, expected, norm_bound=3.0, norm_action="clip")
    assert unbounded.mean_delta["w"].max() > 1e5  # two updates: no median of their own
    bounded = aggregate_deltas(replies, expected, norm_bound=3.0, norm_action="clip",
                               reference_norm=np.sqrt(20.0))
    assert bounded.clipped == [2]
    assert np.linalg.norm(bounded.mean_delta["w"]) <= (1 + 3) / 2 * np.sqrt(20) * (1 + 1e-5)


def test_an_inflated_example_count_is_cut_to_the_cap():
    from fedcomp.codecs.policy import CompressionPolicy

    shapes = {"w": (2,)}
    replies = [ClientReply(i, _payload({"w": np.array([v, v], np.float32)}), n)
               for i, (v, n) in enumerate([(1.0, 10), (1.0, 12), (1.0, 8), (-100.0, 1e9)])]
    result = aggregate_deltas(replies, CompressionPolicy("none").expected(shapes),
                              weight_cap=3.0)
    assert result.weight_capped == [3]
    # Median claim 11: the attacker counts as 33 of 63 examples, not 1e9 of 1e9 + 30.
    assert result.mean_delta["w"][0] == pytest.approx((30 - 3300) / 63, rel=1e-5)


def test_a_robust_rule_ignores_a_minority_of_wild_updates():
    from fedcomp.codecs.policy import CompressionPolicy
    from fedcomp.federated.robust import AggregationRule

    shapes = {"w": (3,)}
    values = [1.0, 1.1, 0.9, 1e7]
    replies = [ClientReply(i, _payload({"w": np.full(3, v, np.float32)}), 1.0)
               for i, v in enumerate(values)]
    result = aggregate_deltas(replies, CompressionPolicy("none").expected(shapes),
                              rule=AggregationRule("median"))
    assert result.accepted == [0, 1, 2, 3]
    np.testing.assert_allclose(result.mean_delta["w"], 1.05, rtol=1e-6)
