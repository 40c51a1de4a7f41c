"""Noise sources: the secure one is Gaussian and never repeats; the seeded one repeats."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from fedcomp.privacy.noise import SecureNoise, SeededNoise, noise_source


def test_secure_noise_is_gaussian_with_the_requested_std():
    draws = SecureNoise().normal(0.7, (400, 500))
    assert draws.shape == (400, 500)
    # 200,000 samples: relative standard error of the std is 0.16 %; 1 % is > 6 SE.
    assert abs(draws.std() / 0.7 - 1) < 0.01
    assert abs(draws.mean()) < 5 * 0.7 / np.sqrt(draws.size)
    # The shape of the distribution, not only its moments (a uniform with the same std
    # would pass the lines above).
    assert stats.kstest(draws.reshape(-1)[:20_000] / 0.7, "norm").pvalue > 1e-4


def test_secure_uniforms_fill_the_unit_interval():
    u = SecureNoise().uniform(100_000)
    assert 0.0 <= u.min() and u.max() < 1.0
    assert stats.kstest(u, "uniform").pvalue > 1e-4


def test_two_secure_sources_never_draw_the_same_noise():
    first, second = SecureNoise().normal(1.0, 1000), SecureNoise().normal(1.0, 1000)
    assert not np.array_equal(first, second)
    assert abs(np.corrcoef(first, second)[0, 1]) < 0.2


def test_seeded_noise_repeats_and_says_it_is_not_private():
    a, b = noise_source(True, [1, 2]), noise_source(True, [1, 2])
    assert a.reproducible and isinstance(a, SeededNoise)
    np.testing.assert_array_equal(a.normal(1.0, 50), b.normal(1.0, 50))
    assert not noise_source(False, [1, 2]).reproducible


@pytest.mark.parametrize("source", [SecureNoise(), SeededNoise(0)])
def test_a_negative_or_nan_std_is_refused(source):
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="std"):
            source.normal(bad, 3)
    assert source.normal(0.0, 4).tolist() == [0.0] * 4
