"""Client-level DP: the clip bound holds for every codec, the noise and epsilon are right."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

from fedcomp.aggregation import ClientReply, aggregate_deltas
from fedcomp.policy import CompressionPolicy, encode_update
from fedcomp.privacy import ClientLevelDP, clip_update, update_norm
from fedcomp.registry import available_codecs
from tests.strategies import CODEC_PARAMS, codec_configs

SHAPES = {"w": (12, 25), "b": (12,)}
TRANSFORMS = sorted(set(available_codecs()) - {"zstd"})
assert set(TRANSFORMS) <= set(CODEC_PARAMS)


@given(config=codec_configs(TRANSFORMS), scale=st.floats(1e-3, 1e3),
       clip=st.floats(0.01, 10.0), seed=st.integers(0, 10**6))
def test_no_contribution_to_the_noisy_sum_exceeds_the_clip_norm(config, scale, clip, seed):
    rng = np.random.default_rng(seed)
    from fedcomp.spec import format_spec
    policy = CompressionPolicy(format_spec([config]), min_numel=0)
    delta = {k: (scale * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}
    clipped, _ = clip_update(delta, clip)        # the client clips ...
    payload = encode_update(clipped, policy, rng=rng).payload   # ... the codec may not
    result = aggregate_deltas([ClientReply(1, payload, 5.0)], policy.expected(SHAPES),
                              clip_norm=clip)     # ... the server re-clips what it decoded
    assert update_norm(result.total) <= clip * (1 + 1e-6)


def test_the_noise_has_the_configured_standard_deviation():
    dp = ClientLevelDP(noise_multiplier=1.3, clip_norm=0.7)
    zero = {"w": np.zeros((1000, 200), np.float32)}
    noise = dp.noisy_mean(zero, expected_participants=1, rng=np.random.default_rng(0))["w"]
    # 200,000 samples: the sample std's relative standard error is 1/sqrt(2N) = 0.16%;
    # a 1% tolerance is over 6 standard errors (false failure rate < 1e-9).
    assert abs(noise.std() / (1.3 * 0.7) - 1) < 0.01
    assert abs(noise.mean()) < 5 * 1.3 * 0.7 / np.sqrt(noise.size)
    # A fixed denominator: dividing by the expected participants scales the noise too.
    halved = dp.noisy_mean(zero, expected_participants=2, rng=np.random.default_rng(0))["w"]
    np.testing.assert_allclose(halved, noise / 2, rtol=1e-6)


def test_without_dp_the_mean_is_exact_and_noise_free():
    rng = np.random.default_rng(0)
    policy = CompressionPolicy("none")
    deltas = [{k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
              for _ in range(3)]
    replies = [ClientReply(i, encode_update(d, policy, rng=rng).payload, 1.0)
               for i, d in enumerate(deltas)]
    mean = aggregate_deltas(replies, policy.expected(SHAPES)).mean_delta
    np.testing.assert_allclose(mean["w"], np.mean([d["w"] for d in deltas], axis=0),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("sigma", "q", "rounds"), [(1.0, 0.1, 20), (0.8, 0.3, 5),
                                                     (2.0, 1.0, 50)])
def test_epsilon_matches_an_independent_rdp_computation_and_grows(sigma, q, rounds):
    dp = ClientLevelDP(noise_multiplier=sigma, clip_norm=1.0, delta=1e-5)
    epsilons = []
    for _ in range(rounds):
        dp.record_round(q)
        epsilons.append(dp.epsilon())
    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    rdp = compute_rdp(q=q, noise_multiplier=sigma, steps=rounds, orders=orders)
    independent, _ = get_privacy_spent(orders=orders, rdp=rdp, delta=1e-5)
    assert epsilons[-1] == pytest.approx(independent, rel=0.01)
    assert all(b > a for a, b in itertools.pairwise(epsilons))


def test_a_target_epsilon_stops_before_it_would_be_exceeded():
    dp = ClientLevelDP(noise_multiplier=1.0, clip_norm=1.0, target_epsilon=3.0)
    rounds = 0
    while not dp.would_exceed(0.2):
        dp.record_round(0.2)
        rounds += 1
    assert rounds > 0 and dp.epsilon() <= 3.0 < dp.epsilon_after(0.2)
    restored = ClientLevelDP(noise_multiplier=1.0, clip_norm=1.0)
    restored.restore(dp.state())
    assert restored.epsilon() == dp.epsilon()


@pytest.mark.slow
def test_a_client_level_dp_simulation_with_compression_records_epsilon(tmp_path):
    import csv

    from fedcomp.config import RunConfig
    from server.simulation import simulate

    cfg = RunConfig(num_server_rounds=3, local_steps=2, local_epochs=0, dp="client",
                    dp_noise_multiplier=1.0, dp_clip_norm=0.5, dp_target_epsilon=50.0,
                    codec="topk:ratio=0.05|quant:bits=4", results_dir=str(tmp_path),
                    run_name="dp")
    summary, _ = simulate(cfg, num_supernodes=3)
    with open(tmp_path / "dp" / "rounds.csv") as handle:
        epsilons = [float(r["epsilon"]) for r in csv.DictReader(handle)]
    assert summary["rounds_completed"] == len(epsilons) >= 1
    assert all(b > a for a, b in itertools.pairwise(epsilons))
    assert summary["epsilon"] == pytest.approx(epsilons[-1]) and summary["epsilon"] <= 50.0
    # With q = 1 and sigma = 1 the third round would cost more than 50: it stops early.
    cfg_tight = cfg.replace(run_name="tight", dp_target_epsilon=epsilons[0] + 0.01)
    tight, _ = simulate(cfg_tight, num_supernodes=3)
    assert tight["rounds_completed"] == 1 and "stopped before round 2" in tight["stopped_early"]


# ------------------------------------------------------------------ adaptive clipping
@pytest.mark.parametrize(("quantile", "sigma_log"), [(0.5, 0.5), (0.8, 0.5), (0.3, 1.0)])
def test_adaptive_clipping_converges_to_the_target_quantile(quantile, sigma_log):
    from scipy.stats import norm

    from fedcomp.privacy import AdaptiveClipping

    rng = np.random.default_rng(0)
    clipper = AdaptiveClipping(clip_norm=0.05, target_quantile=quantile, learning_rate=0.2,
                               count_stddev=100 / 20)
    history = []
    for _ in range(400):  # 100 clients a round with log-normal update norms
        norms = np.exp(rng.normal(0.0, sigma_log, size=100))
        history.append(clipper.update(int((norms <= clipper.clip_norm).sum()), 100, rng))
    true_quantile = float(np.exp(sigma_log * norm.ppf(quantile)))
    settled = float(np.median(history[-100:]))
    # Started 20x too small; it must find the quantile within 10 %.
    assert settled == pytest.approx(true_quantile, rel=0.10)
    # And the fraction of norms left unclipped at that C is the target.
    fresh = np.exp(rng.normal(0.0, sigma_log, size=200_000))
    assert float((fresh <= settled).mean()) == pytest.approx(quantile, abs=0.04)


def test_adaptive_noise_multiplier_spends_part_of_the_budget_on_the_count():
    from fedcomp.privacy import adaptive_noise_multiplier

    z = adaptive_noise_multiplier(1.0, 5.0)
    assert z == pytest.approx((1.0 - 0.01) ** -0.5)
    assert z > 1.0  # more noise on the update than the accounted multiplier
    with pytest.raises(ValueError, match="must exceed half the noise multiplier"):
        adaptive_noise_multiplier(2.0, 1.0)
    dp = ClientLevelDP(noise_multiplier=1.0, clip_norm=2.0, update_noise_multiplier=z)
    assert dp.noise_std == pytest.approx(z * 2.0)


# ------------------------------------------------------------------ sample-level DP
def _digits_slice(n=64):
    from fedcomp.data import load_dataset

    train, _ = load_dataset("digits")
    return train.x[:n], train.y[:n]


def test_dp_sgd_keeps_one_accountant_across_rounds_and_plain_state_dict_keys():
    from fedcomp.models import build_model
    from fedcomp.privacy import train_dp_sgd
    from fedcomp.training import state_arrays

    x, y = _digits_slice()
    model = build_model("digits", seed=0)
    names = list(model.state_dict())
    before = state_arrays(model)
    history: list = []
    epsilons = []
    for round_seed in range(2):
        model = build_model("digits", seed=0)
        _, history, eps = train_dp_sgd(
            model, x, y, epochs=0, steps=5, batch_size=16, lr=0.05, momentum=0.0,
            noise_multiplier=1.1, max_grad_norm=1.0, history=history, delta=1e-5,
            seed=round_seed)
        epsilons.append(eps)
    assert list(model.state_dict()) == names  # no "_module." prefix
    after = state_arrays(model)
    assert any(not np.array_equal(before[k], after[k]) for k in names)  # it trained
    # One accountant: 10 steps in all at q = 16/64, not twice 5.
    assert sum(steps for _, _, steps in history) == 10
    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    rdp = compute_rdp(q=16 / 64, noise_multiplier=1.1, steps=10, orders=orders)
    independent, _ = get_privacy_spent(orders=orders, rdp=rdp, delta=1e-5)
    assert epsilons[1] == pytest.approx(independent, rel=0.01)
    assert epsilons[1] > epsilons[0] > 0


def test_dp_sgd_clips_per_example_gradients():
    """With no noise and a tiny clip, one DP-SGD step moves the model by at most lr * C."""
    import torch

    from fedcomp.models import build_model
    from fedcomp.privacy import train_dp_sgd, update_norm
    from fedcomp.training import state_arrays

    x, y = _digits_slice(32)
    model = build_model("digits", seed=0)
    before = state_arrays(model)
    torch.manual_seed(0)
    train_dp_sgd(model, x, y, epochs=0, steps=1, batch_size=32, lr=1.0, momentum=0.0,
                 noise_multiplier=0.0, max_grad_norm=1e-3, history=[], delta=1e-5, seed=0)
    moved = update_norm({k: state_arrays(model)[k] - before[k] for k in before})
    assert 0 < moved <= 1e-3 * (1 + 1e-4)  # mean of clipped grads: norm <= C


def test_client_state_keeps_the_accountant_history():
    from fedcomp.client_round import ClientState, model_shapes
    from fedcomp.config import RunConfig

    cfg = RunConfig(dp="sample")
    state = ClientState.fresh(cfg)
    state.dp_history = [(1.1, 0.25, 5), (1.1, 0.25, 7)]
    restored = ClientState.from_arrays(cfg, state.to_arrays(), model_shapes("digits"))
    assert restored.dp_history == state.dp_history


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["client-adaptive", "sample"])
def test_each_dp_mode_completes_two_compressed_rounds(tmp_path, mode):
    import csv

    from fedcomp.config import RunConfig
    from server.simulation import simulate

    extra = (dict(dp="client", dp_adaptive_clip=True, dp_clip_norm=0.05)
             if mode == "client-adaptive" else dict(dp="sample", dp_clip_norm=1.0))
    cfg = RunConfig(num_server_rounds=2, local_steps=4, local_epochs=0,
                    dp_noise_multiplier=1.0, codec="topk:ratio=0.05|quant:bits=4",
                    results_dir=str(tmp_path), run_name=mode, **extra)
    summary, _ = simulate(cfg, num_supernodes=3)
    with open(tmp_path / mode / "rounds.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert summary["rounds_completed"] == 2
    assert sum(int(r["clients_ok"]) for r in rows) == 6
    epsilons = [float(r["epsilon"]) for r in rows]
    assert 0 < epsilons[0] < epsilons[1] == pytest.approx(summary["epsilon"])
    if mode == "client-adaptive":
        # C = 0.05 is far below these update norms: every client is clipped, C grows.
        assert float(rows[0]["dp_clip"]) == pytest.approx(0.05)
        assert summary["dp_final_clip"] > 0.05
    else:
        with open(tmp_path / mode / "clients.csv") as handle:
            clients = list(csv.DictReader(handle))
        assert len(clients) == 6
        # With a target just above round 1's epsilon, the server stops before round 2.
        tight, _ = simulate(cfg.replace(run_name="tight", num_server_rounds=3,
                                        dp_target_epsilon=epsilons[0] * 1.01),
                            num_supernodes=3)
        assert tight["rounds_completed"] == 1
        assert "stopped before round 2" in tight["stopped_early"]
        assert tight["epsilon"] <= epsilons[0] * 1.01


def test_dp_sgd_refuses_a_round_that_would_exceed_the_target_and_leaves_the_model():
    from fedcomp.models import build_model
    from fedcomp.privacy import PrivacyBudgetExhausted, train_dp_sgd
    from fedcomp.training import state_arrays

    x, y = _digits_slice()
    kwargs = dict(epochs=1, steps=0, batch_size=16, lr=0.05, momentum=0.0,
                  noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, seed=0)
    _, history, eps = train_dp_sgd(build_model("digits", seed=0), x, y, history=[], **kwargs)
    model = build_model("digits", seed=0)
    before = state_arrays(model)
    with pytest.raises(PrivacyBudgetExhausted, match="dp-target-epsilon"):
        train_dp_sgd(model, x, y, history=history, target_epsilon=eps * 1.01, **kwargs)
    assert all(np.array_equal(before[k], v) for k, v in state_arrays(model).items())
    # A target the next round fits under is fine.
    train_dp_sgd(model, x, y, history=history, target_epsilon=eps * 3, **kwargs)


def test_the_server_predicts_each_clients_dp_sgd_epsilon_from_their_reports():
    from fedcomp.privacy import SampleLevelBudget

    budget = SampleLevelBudget(noise_multiplier=1.1, delta=1e-5, target_epsilon=5.0)
    assert not budget.would_exceed()  # nothing spent yet
    budget.record(0, 0.25, 8)
    budget.record(1, 0.1, 20)
    budget.record(0, 0.25, 8)
    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    rdp = compute_rdp(q=0.25, noise_multiplier=1.1, steps=24, orders=orders)
    expected, _ = get_privacy_spent(orders=orders, rdp=rdp, delta=1e-5)
    # Client 0 (q = 0.25, 16 steps so far, 8 a round) is the most exposed.
    assert budget.epsilon_after_next_round() == pytest.approx(expected, rel=0.01)
    assert budget.would_exceed() == (expected > 5.0)
    restored = SampleLevelBudget(1.1, 1e-5, 5.0)
    restored.restore(budget.state())
    assert restored.spent == budget.spent
