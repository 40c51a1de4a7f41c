"""Accounting: PLD and RDP agree with independent implementations; PLD is tighter."""

from __future__ import annotations

import itertools

import pytest

from fedcomp.privacy.accounting import (
    PrivacyAccountant,
    dp_sgd_plan,
    epsilon_of,
    noise_multiplier_for,
)

CASES = [(1.0, 0.1, 20), (0.8, 0.3, 5), (2.0, 1.0, 50), (1.1, 0.03, 400)]


@pytest.mark.parametrize(("sigma", "q", "steps"), CASES)
def test_rdp_matches_opacus_rdp_analysis(sigma, q, steps):
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    independent, _ = get_privacy_spent(
        orders=orders, rdp=compute_rdp(q=q, noise_multiplier=sigma, steps=steps,
                                       orders=orders), delta=1e-5)
    assert epsilon_of([(sigma, q, steps)], 1e-5, "rdp") == pytest.approx(independent, rel=0.01)


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # Opacus' PRV at q = 1
@pytest.mark.parametrize(("sigma", "q", "steps"), CASES)
def test_pld_matches_opacus_prv_and_is_below_rdp(sigma, q, steps):
    from opacus.accountants import PRVAccountant

    prv = PRVAccountant()
    prv.history = [(sigma, q, steps)]
    independent = prv.get_epsilon(delta=1e-5, eps_error=0.01)
    pld = epsilon_of([(sigma, q, steps)], 1e-5, "pld")
    assert pld == pytest.approx(independent, rel=0.02)
    assert pld < epsilon_of([(sigma, q, steps)], 1e-5, "rdp")


def test_pld_needs_less_noise_than_rdp_for_one_epsilon():
    # 20 full-participation rounds at epsilon 1, delta 1e-5.
    pld = noise_multiplier_for(1.0, 1e-5, 1.0, 20, "pld")
    rdp = noise_multiplier_for(1.0, 1e-5, 1.0, 20, "rdp")
    assert pld == pytest.approx(16.68, abs=0.05)
    assert rdp == pytest.approx(18.13, abs=0.05)
    assert epsilon_of([(pld, 1.0, 20)], 1e-5, "pld") <= 1.0


def test_the_accountant_merges_equal_steps_and_epsilon_grows():
    accountant = PrivacyAccountant()
    epsilons = []
    for _ in range(5):
        accountant.step(1.0, 0.1)
        epsilons.append(accountant.epsilon(1e-5))
    assert accountant.history == [(1.0, 0.1, 5)]
    assert all(b > a for a, b in itertools.pairwise(epsilons))
    assert accountant.epsilon_after(1.0, 0.1, 1, 1e-5) == pytest.approx(
        epsilon_of([(1.0, 0.1, 6)], 1e-5))
    restored = PrivacyAccountant()
    restored.restore(accountant.state())
    assert restored.epsilon(1e-5) == accountant.epsilon(1e-5)


@pytest.mark.parametrize("entry", [[1.0, 0.1], [0.0, 0.1, 3], [1.0, 1.5, 3], [1.0, 0.1, -1],
                                   [float("nan"), 0.1, 3]])
def test_a_corrupt_history_is_refused(entry):
    with pytest.raises(ValueError):
        PrivacyAccountant().restore([entry])


def test_unknown_methods_and_impossible_deltas_are_refused():
    with pytest.raises(ValueError, match="accountant"):
        PrivacyAccountant("gdp")
    with pytest.raises(ValueError, match="delta"):
        epsilon_of([(1.0, 0.1, 3)], 1.0)
    assert epsilon_of([], 1e-5) == 0.0


def test_dp_sgd_plan_follows_opacus_rate_and_epochs():
    assert dp_sgd_plan(100, batch_size=32, epochs=2, steps=0) == (0.32, 8)
    assert dp_sgd_plan(10, batch_size=32, epochs=1, steps=5) == (1.0, 5)
