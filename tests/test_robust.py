"""Robust aggregation rules: properties a wrong rule would break."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedcomp.errors import SpecError
from fedcomp.federated.robust import AggregationRule, parse_rule


def _updates(seed: int, honest: int, attackers: int, scale: float = 1e6):
    rng = np.random.default_rng(seed)
    center = rng.standard_normal(50)
    good = [{"w": (center + 0.1 * rng.standard_normal(50)).astype(np.float32)}
            for _ in range(honest)]
    bad = [{"w": (scale * rng.standard_normal(50)).astype(np.float32)} for _ in range(attackers)]
    return center, good, bad


@given(seed=st.integers(0, 10**6), honest=st.integers(3, 12), share=st.floats(0.0, 0.45))
def test_the_median_stays_within_the_honest_range_when_attackers_are_a_minority(
        seed, honest, share):
    attackers = min(int(share * honest), honest - 1)
    _, good, bad = _updates(seed, honest, attackers)
    if attackers >= honest - attackers:  # the median needs a strict honest majority
        return
    out = AggregationRule("median").combine(good + bad)["w"]
    stacked = np.stack([u["w"] for u in good])
    assert np.all(out >= stacked.min(axis=0) - 1e-6) and np.all(out <= stacked.max(axis=0) + 1e-6)


def test_trimmed_mean_drops_beta_of_each_end_and_equals_the_mean_at_zero():
    values = [{"w": np.array([float(v)])} for v in (1, 2, 3, 4, 1000)]
    assert AggregationRule("trimmed", beta=0.2).combine(values)["w"][0] == pytest.approx(3.0)
    assert AggregationRule("trimmed", beta=0.0).combine(values)["w"][0] == pytest.approx(202.0)


@pytest.mark.parametrize("m", [1, 3])
def test_krum_picks_updates_from_the_honest_cluster(m):
    center, good, bad = _updates(0, honest=8, attackers=2)
    out = AggregationRule("krum", f=2, m=m).combine(bad + good)["w"]
    # An honest update is 0.7 from the centre on average (0.1 x sqrt(50)).
    assert np.linalg.norm(out - center) < 1.2


def test_krum_with_too_few_updates_falls_back_to_the_median():
    _, good, _ = _updates(1, honest=3, attackers=0)
    np.testing.assert_allclose(AggregationRule("krum", f=1).combine(good)["w"],
                               AggregationRule("median").combine(good)["w"])


@pytest.mark.parametrize(("spec", "rule"), [
    ("mean", AggregationRule()), ("median", AggregationRule("median")),
    ("trimmed:beta=0.2", AggregationRule("trimmed", beta=0.2)),
    ("krum:f=2,m=3", AggregationRule("krum", f=2, m=3))])
def test_rules_parse_from_spec_strings(spec, rule):
    assert parse_rule(spec) == rule


@pytest.mark.parametrize(("spec", "fragment"), [
    ("mode", "unknown aggregation rule"), ("trimmed:beta=0.5", "beta"),
    ("krum:f=-1", "krum"), ("median:beta=0.1", "no parameter"), ("mean|median", "one stage")])
def test_bad_rules_are_refused_with_a_message(spec, fragment):
    with pytest.raises(SpecError, match=fragment):
        parse_rule(spec)
