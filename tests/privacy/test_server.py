"""ServerPrivacy's hooks: secret noise and sample, a release every round, refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedcomp.config import RunConfig
from fedcomp.errors import SpecError
from fedcomp.federated.aggregation import AggregationResult
from fedcomp.privacy.server import ServerPrivacy

CLIENT = RunConfig(dp="client", clients_per_round=10, dp_noise_multiplier=1.0,
                   dp_clip_norm=0.5)
SHAPES = {"w": (50, 40), "b": (50,)}


def _nothing_arrived() -> AggregationResult:
    return AggregationResult(mean_delta=None)


def test_two_runs_with_the_same_seed_draw_different_noise_and_samples():
    releases, samples = [], []
    for _ in range(2):
        privacy = ServerPrivacy(CLIENT)
        samples.append(privacy.sample(list(range(1000))))
        releases.append(privacy.release(_nothing_arrived(), SHAPES, {}))
    assert not np.array_equal(releases[0]["w"], releases[1]["w"])
    assert samples[0] != samples[1]


def test_reproducible_noise_repeats_and_is_recorded_as_not_private():
    cfg = CLIENT.replace(dp_reproducible_noise=True)
    first, second = ServerPrivacy(cfg), ServerPrivacy(cfg)
    assert first.sample(list(range(100))) == second.sample(list(range(100)))
    np.testing.assert_array_equal(first.release(_nothing_arrived(), SHAPES, {})["w"],
                                  second.release(_nothing_arrived(), SHAPES, {})["w"])
    assert "NOT PRIVATE" in first.summary()["dp_noise"]
    assert ServerPrivacy(CLIENT).summary()["dp_noise"] == "os-entropy"


def test_a_round_with_no_update_still_releases_noise_and_is_accounted():
    privacy = ServerPrivacy(CLIENT)
    privacy.sample(list(range(100)))
    mean = privacy.release(_nothing_arrived(), SHAPES, {})
    assert set(mean) == set(SHAPES) and all(np.any(v != 0) for v in mean.values())
    # std sigma * C / expected participants, with q = 10 / 100
    assert np.std(mean["w"]) == pytest.approx(1.0 * 0.5 / 10, rel=0.05)
    assert privacy.epsilon() > 0 and privacy.central.accountant.history == [(1.0, 0.1, 1)]


def test_the_client_sample_is_poisson_with_a_fixed_denominator():
    privacy = ServerPrivacy(CLIENT)
    sizes = {len(privacy.sample(list(range(200)))) for _ in range(30)}
    assert len(sizes) > 1  # not a fixed-size sample
    assert privacy.rate == pytest.approx(0.05) and privacy.expected == pytest.approx(10.0)


def test_checkpoint_state_holds_no_noise_generator():
    privacy = ServerPrivacy(CLIENT.replace(dp_adaptive_clip=True))
    privacy.sample(list(range(100)))
    privacy.release(_nothing_arrived(), SHAPES, {})
    state = privacy.state_dict()
    assert set(state) == {"history", "clip", "sample_budget"}
    assert "state" not in json.dumps(state) and "bit_generator" not in json.dumps(state)
    restored = ServerPrivacy(CLIENT.replace(dp_adaptive_clip=True))
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.epsilon() == privacy.epsilon()
    assert restored.clip_norm == privacy.clip_norm


def test_a_delta_of_one_over_n_stops_before_round_one():
    privacy = ServerPrivacy(CLIENT.replace(dp_delta=0.01))
    with pytest.raises(SpecError, match=r"'dp-delta'.*1/N"):
        privacy.sample(list(range(100)))
    privacy = ServerPrivacy(RunConfig(dp="sample", dp_delta=0.01))
    with pytest.raises(SpecError, match=r"'dp-delta'.*largest client's n = 100"):
        privacy.check_sample_plans({0: (0.5, 4, 64), 1: (0.5, 4, 100)})


def test_a_target_epsilon_no_round_can_meet_stops_before_round_one():
    privacy = ServerPrivacy(CLIENT.replace(dp_target_epsilon=0.01))
    with pytest.raises(SpecError, match=r"'dp-target-epsilon'.*cannot be met"):
        privacy.sample(list(range(100)))
    privacy = ServerPrivacy(RunConfig(dp="sample", dp_target_epsilon=0.05))
    with pytest.raises(SpecError, match=r"'dp-target-epsilon'.*partition 3"):
        privacy.check_sample_plans({3: (0.5, 20, 64)})


def test_a_target_epsilon_stops_the_run_before_the_round_that_would_exceed_it():
    privacy = ServerPrivacy(CLIENT.replace(dp_target_epsilon=3.0))
    rounds = 0
    while True:
        privacy.sample(list(range(100)))
        if privacy.stop_reason(rounds + 1):
            break
        privacy.release(_nothing_arrived(), SHAPES, {})
        rounds += 1
    assert rounds > 0 and privacy.epsilon() <= 3.0 < privacy.central.epsilon_after(0.1)
    assert f"stopped before round {rounds + 1}" in privacy.stop_reason(rounds + 1)


def test_noise_covers_only_the_coordinates_in_the_shapes_it_is_given():
    privacy = ServerPrivacy(CLIENT.replace(dp_reproducible_noise=True))
    privacy.sample(list(range(100)))
    compact = {"w": (20,), "b": (50,)}  # a subspace's 20 values of w, and b whole
    mean = privacy.release(_nothing_arrived(), compact, {})
    assert {k: v.shape for k, v in mean.items()} == compact


@pytest.mark.parametrize("bad", [
    dict(dp="client", norm_bound=5.0),
    dict(dp="client", aggregation="median"),
    dict(dp="client", dp_noise_multiplier=0.0),
    dict(dp="sample", dp_clip_norm=-1.0),
    dict(dp="client", dp_delta=1.0),
    dict(shared_randk=1.5),
])
def test_impossible_privacy_settings_are_refused_at_config_time(bad):
    with pytest.raises(SpecError, match="run config"):
        RunConfig(**bad)
