"""ModelAverage: the server's exponential moving average of its models."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcomp.federated.averaging import ModelAverage

SHAPES = {"w": (4, 5), "b": (3,)}


def _models(seed: int, count: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
            for _ in range(count)]


@settings(max_examples=40, deadline=None)
@given(decay=st.floats(0.0, 0.99), count=st.integers(1, 30), seed=st.integers(0, 2**16))
def test_the_average_is_the_warmed_up_exponential_weighting_of_every_model(decay, count,
                                                                           seed):
    initial, *models = _models(seed, count + 1)
    average = ModelAverage(decay, initial)
    for model in models:
        average.update(model)
    # Reference in float64: weight of each model from the decays actually used.
    decays = [min(decay, (1 + t) / (10 + t)) for t in range(len(models))]
    weights = [float(np.prod(decays))]
    weights += [(1 - d) * float(np.prod(decays[i + 1:])) for i, d in enumerate(decays)]
    assert sum(weights) == pytest.approx(1.0)
    for name in SHAPES:
        expected = sum(w * m[name].astype(np.float64)
                       for w, m in zip(weights, [initial, *models], strict=True))
        np.testing.assert_allclose(average.value[name], expected, rtol=1e-5, atol=1e-5)
        # A convex combination: never outside what the models spanned.
        stack = np.stack([m[name] for m in [initial, *models]])
        assert np.all(average.value[name] <= stack.max(axis=0) + 1e-5)
        assert np.all(average.value[name] >= stack.min(axis=0) - 1e-5)
    assert average.updates == len(models)


def test_decay_zero_keeps_only_the_latest_model_and_warm_up_forgets_the_initial_one():
    initial, first, second = _models(1, 3)
    latest = ModelAverage(0.0, initial)
    latest.update(first)
    latest.update(second)
    for name in SHAPES:
        np.testing.assert_array_equal(latest.value[name], second[name])
    warm = ModelAverage(0.99, initial)
    assert warm.current_decay() == pytest.approx(0.1)  # not 0.99 at the first update
    warm.update(first)
    for name in SHAPES:
        np.testing.assert_allclose(warm.value[name], 0.1 * initial[name] + 0.9 * first[name],
                                   rtol=1e-6, atol=1e-6)
    # The average does not alias the arrays it was given.
    assert all(warm.value[k] is not initial[k] for k in SHAPES)


def test_a_checkpointed_average_continues_exactly_as_an_uninterrupted_one():
    initial, *models = _models(2, 9)
    straight = ModelAverage(0.9, initial)
    for model in models:
        straight.update(model)
    first = ModelAverage(0.9, initial)
    for model in models[:4]:
        first.update(model)
    resumed = ModelAverage(0.9, initial)
    resumed.load_state_dict(first.state_dict())
    for model in models[4:]:
        resumed.update(model)
    assert resumed.updates == straight.updates
    for name in SHAPES:
        np.testing.assert_array_equal(resumed.value[name], straight.value[name])


def test_bad_decays_and_foreign_models_are_refused_by_name():
    initial = _models(3, 1)[0]
    for decay in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match="decay"):
            ModelAverage(decay, initial)
    average = ModelAverage(0.5, initial)
    with pytest.raises(ValueError, match="differ"):
        average.update({"w": initial["w"]})
    with pytest.raises(ValueError, match="'b'"):
        average.update({"w": initial["w"], "b": np.zeros(4, np.float32)})
    with pytest.raises(ValueError, match="does not match"):
        average.load_state_dict({"value/w": initial["w"], "updates": np.array(1)})
