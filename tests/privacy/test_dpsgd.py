"""Sample-level DP-SGD: one accountant, clipped examples, secret noise and batches, masks."""

from __future__ import annotations

import numpy as np
import pytest

from fedcomp.privacy import PrivacyAccountant, RandomSubspace, SecureNoise, SeededNoise
from fedcomp.privacy.accounting import epsilon_of
from fedcomp.privacy.clipping import update_norm
from fedcomp.privacy.dpsgd import PrivacyBudgetExhausted, train_dp_sgd
from fedcomp.tasks.models import build_model
from fedcomp.tasks.training import state_arrays


def _digits(n=64):
    from fedcomp.tasks.data import load_dataset

    train, _ = load_dataset("digits")
    return train.x[:n], train.y[:n]


def _train(model, x, y, noise, **overrides):
    kwargs = dict(epochs=0, steps=4, batch_size=16, lr=0.05, momentum=0.0,
                  noise_multiplier=1.0, max_grad_norm=1.0, accountant=PrivacyAccountant(),
                  delta=1e-5, noise=noise)
    kwargs.update(overrides)
    return train_dp_sgd(model, x, y, **kwargs)


def _moved(model, before):
    return {k: state_arrays(model)[k] - before[k] for k in before}


def test_dp_sgd_keeps_one_accountant_across_rounds_and_plain_state_dict_keys():
    x, y = _digits()
    accountant = PrivacyAccountant()
    names = list(build_model("digits", seed=0).state_dict())
    for _ in range(2):
        model = build_model("digits", seed=0)
        assert _train(model, x, y, SecureNoise(), steps=5, accountant=accountant) == (0.25, 5)
    assert list(model.state_dict()) == names  # no "_module." prefix, no Opacus hooks left
    assert not hasattr(next(model.parameters()), "grad_sample")
    # One accountant: 10 steps in all at q = 16/64, not twice 5.
    assert accountant.history == [(1.0, 0.25, 10)]
    assert accountant.epsilon(1e-5) == pytest.approx(epsilon_of([(1.0, 0.25, 10)], 1e-5))


def test_dp_sgd_clips_per_example_gradients():
    """With no noise and a tiny clip, one step moves the model by at most lr * C."""
    x, y = _digits(32)
    model = build_model("digits", seed=0)
    before = state_arrays(model)
    _train(model, x, y, SeededNoise(0), steps=1, batch_size=32, lr=1.0, noise_multiplier=0.0,
           max_grad_norm=1e-3)
    moved = update_norm(_moved(model, before))
    assert 0 < moved <= 1e-3 * (1 + 1e-4)  # the mean of clipped gradients: norm <= C


def test_the_noise_and_the_batches_are_secret_by_default_and_repeat_only_when_seeded():
    x, y = _digits()
    runs = {}
    for label, noise in (("secure-1", SecureNoise()), ("secure-2", SecureNoise()),
                         ("seeded-1", SeededNoise(3)), ("seeded-2", SeededNoise(3))):
        model = build_model("digits", seed=0)
        before = state_arrays(model)
        _train(model, x, y, noise)
        runs[label] = _moved(model, before)
    assert not np.array_equal(runs["secure-1"]["fc1.weight"], runs["secure-2"]["fc1.weight"])
    for name in runs["seeded-1"]:
        np.testing.assert_array_equal(runs["seeded-1"][name], runs["seeded-2"][name])


def test_an_empty_poisson_batch_still_takes_a_noisy_step():
    x, y = _digits(1000)
    model = build_model("digits", seed=0)
    before = state_arrays(model)
    # q = 1/1000: almost every batch is empty, and every step must still be noised.
    _train(model, x, y, SeededNoise(0), steps=3, batch_size=1, lr=1.0)
    moved = _moved(model, before)
    assert all(np.count_nonzero(v) == v.size for v in moved.values())


def test_with_masks_the_update_and_its_noise_stay_in_the_subspace():
    x, y = _digits()
    model = build_model("digits", seed=0)
    before = state_arrays(model)
    masks = RandomSubspace(0.1, 0, 1).masks({k: v.shape for k, v in before.items()})
    _train(model, x, y, SecureNoise(), masks=masks, momentum=0.9)
    moved = _moved(model, before)
    for name, delta in moved.items():
        assert not delta[~masks[name]].any()
        assert np.count_nonzero(delta[masks[name]]) == masks[name].sum()


def test_dp_sgd_refuses_a_round_that_would_exceed_the_target_and_leaves_the_model():
    x, y = _digits()
    accountant = PrivacyAccountant()
    _train(build_model("digits", seed=0), x, y, SecureNoise(), accountant=accountant)
    eps = accountant.epsilon(1e-5)
    model = build_model("digits", seed=0)
    before = state_arrays(model)
    with pytest.raises(PrivacyBudgetExhausted, match="dp-target-epsilon"):
        _train(model, x, y, SecureNoise(), accountant=accountant, target_epsilon=eps * 1.01)
    assert all(np.array_equal(before[k], v) for k, v in state_arrays(model).items())
    assert accountant.history == [(1.0, 0.25, 4)]  # the refused round spent nothing
    _train(model, x, y, SecureNoise(), accountant=accountant, target_epsilon=eps * 3)
