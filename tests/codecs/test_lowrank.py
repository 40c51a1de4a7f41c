"""Low-rank: exact on matrices of rank <= r, factors travel, 1-D tensors folded."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fedcomp.codecs.lowrank import matrix_view_shape
from fedcomp.codecs.pipeline import Pipeline


@given(rows=st.integers(2, 40), cols=st.integers(2, 40), rank=st.integers(1, 4),
       seed=st.integers(0, 1000))
def test_matrices_of_rank_at_most_r_are_reconstructed(rows, cols, rank, seed):
    rng = np.random.default_rng(seed)
    true_rank = min(rank, rows, cols)
    m = (rng.standard_normal((rows, true_rank)) @ rng.standard_normal((true_rank, cols)))
    m = m.astype(np.float32)
    encoded, decoded = Pipeline.parse(f"lowrank:rank={rank}").roundtrip(
        m, rng=np.random.default_rng(seed))
    np.testing.assert_allclose(decoded, m, atol=1e-3 * max(1.0, float(np.abs(m).max())))
    assert encoded.nbytes == 4 * (rows + cols) * true_rank


def test_rank_r_captures_the_top_singular_directions():
    rng = np.random.default_rng(0)
    u, _ = np.linalg.qr(rng.standard_normal((60, 60)))
    v, _ = np.linalg.qr(rng.standard_normal((50, 50)))
    s = np.array([10, 8, 6] + [0.1] * 47)
    m = (u[:, :50] * s) @ v.T
    _, decoded = Pipeline.parse("lowrank:rank=3,iters=3").roundtrip(
        m.astype(np.float32), rng=np.random.default_rng(1))
    best = (u[:, :3] * s[:3]) @ v[:, :3].T  # the optimal rank-3 approximation
    assert np.linalg.norm(decoded - best) < 0.05 * np.linalg.norm(best)


def test_one_dimensional_tensors_are_folded_into_a_near_square_matrix():
    assert matrix_view_shape((10,)) == (4, 3)
    assert matrix_view_shape((100,)) == (10, 10)
    assert matrix_view_shape((7, 3, 3)) == (7, 9)
    x = np.random.default_rng(0).standard_normal(10).astype(np.float32)
    _, decoded = Pipeline.parse("lowrank:rank=3").roundtrip(x, rng=np.random.default_rng(0))
    np.testing.assert_allclose(decoded, x, atol=1e-5)


def test_factors_stay_open_for_a_following_value_stage():
    m = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    encoded = Pipeline.parse("lowrank:rank=2|fp16").encode(m, rng=np.random.default_rng(0))
    assert encoded.parts["p"].codec == "fp16" and encoded.parts["q"].codec == "fp16"
