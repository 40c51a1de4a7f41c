"""Server optimizers against their update rules, computed by hand."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fedcomp.federated.server_opt import ServerOptimizer

W = {"w": np.array([1.0, -2.0, 0.5], dtype=np.float32)}
D1 = {"w": np.array([0.1, 0.2, -0.3], dtype=np.float32)}
D2 = {"w": np.array([0.3, -0.1, 0.0], dtype=np.float32)}


def test_sgd_with_server_lr_one_is_fedavg():
    np.testing.assert_allclose(ServerOptimizer("sgd").step(W, D1)["w"], W["w"] + D1["w"])
    np.testing.assert_allclose(ServerOptimizer("sgd", lr=0.5).step(W, D1)["w"],
                               W["w"] + 0.5 * D1["w"])


def test_momentum_accumulates_velocity():
    opt = ServerOptimizer("momentum", lr=1.0, momentum=0.9)
    w1 = opt.step(W, D1)
    w2 = opt.step(w1, D2)
    np.testing.assert_allclose(w2["w"], W["w"] + D1["w"] + (0.9 * D1["w"] + D2["w"]),
                               rtol=1e-6)


@pytest.mark.parametrize("kind", ["adam", "yogi"])
def test_adaptive_rules(kind):
    lr, b1, b2, tau = 0.1, 0.9, 0.99, 1e-3
    opt = ServerOptimizer(kind, lr=lr, beta1=b1, beta2=b2, tau=tau)
    w, m, v = W["w"].astype(np.float64), 0.0, np.full(3, tau**2)
    current = W
    for d in (D1["w"], D2["w"]):
        current = opt.step(current, {"w": d})
        m = b1 * m + (1 - b1) * d
        v = (b2 * v + (1 - b2) * d**2 if kind == "adam"
             else v - (1 - b2) * d**2 * np.sign(v - d**2))
        w = w + lr * m / (np.sqrt(v) + tau)
    np.testing.assert_allclose(current["w"], w, rtol=1e-5)


def test_state_round_trips_and_bad_kind_is_named():
    opt = ServerOptimizer("adam")
    opt.step(W, D1)
    other = ServerOptimizer("adam")
    other.load_state_dict(opt.state_dict())
    np.testing.assert_array_equal(other.step(W, D2)["w"], opt.step(W, D2)["w"])
    with pytest.raises(ValueError, match="unknown server optimizer 'adagrad'"):
        ServerOptimizer("adagrad")


def test_cosine_schedule_anneals_from_lr_to_lr_final_over_total_steps():
    opt = ServerOptimizer("sgd", lr=0.02, schedule="cosine", lr_final=0.002, total_steps=5)
    rates = [opt.lr_at(step) for step in range(1, 8)]
    np.testing.assert_allclose(rates[0], 0.02)
    np.testing.assert_allclose(rates[2], 0.011)  # halfway: the mean of the two
    np.testing.assert_allclose(rates[4:], 0.002)  # the last step and after
    assert all(a > b for a, b in itertools.pairwise(rates[:5]))
    # The step uses the scheduled rate, and a resumed optimizer continues it.
    w = W
    for _ in range(3):
        w = opt.step(w, D1)
    np.testing.assert_allclose(w["w"], W["w"] + sum(rates[:3]) * D1["w"], rtol=1e-6)
    resumed = ServerOptimizer("sgd", lr=0.02, schedule="cosine", lr_final=0.002, total_steps=5)
    resumed.load_state_dict(opt.state_dict())
    np.testing.assert_allclose(resumed.step(w, D1)["w"], w["w"] + rates[3] * D1["w"], rtol=1e-6)
    assert ServerOptimizer("sgd", lr=0.3).lr_at(100) == 0.3  # constant by default
    with pytest.raises(ValueError, match="schedule 'step'"):
        ServerOptimizer("sgd", schedule="step")


@pytest.mark.parametrize("kind", ["sgd", "momentum", "adam", "yogi"])
def test_a_step_that_would_not_be_finite_is_refused_and_leaves_the_state(kind):
    opt = ServerOptimizer(kind, lr=1.0)
    model = {"w": np.ones(4, np.float32)}
    assert opt.step_if_finite(model, {"w": np.full(4, 0.1, np.float32)}) is not None
    before = {k: v.copy() for k, v in opt.state.items()}
    huge = {"w": np.full(4, np.finfo(np.float32).max, np.float32)}
    bigger = {"w": np.full(4, np.finfo(np.float32).max, np.float32)}
    assert opt.step_if_finite(huge, bigger) is None
    assert opt.steps == 1 and all(np.array_equal(before[k], opt.state[k]) for k in before)
