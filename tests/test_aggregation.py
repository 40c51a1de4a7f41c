"""Uplink aggregation: exact weighted mean, and each bad reply rejected on its own."""

from __future__ import annotations

import numpy as np
import pytest

from fedcomp.aggregation import ClientReply, aggregate_deltas
from fedcomp.policy import CompressionPolicy, encode_update

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
