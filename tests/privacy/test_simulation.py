"""DP runs end to end in Flower's simulation engine (slow)."""

from __future__ import annotations

import csv
import itertools
import json

import numpy as np
import pytest

from fedcomp.config import RunConfig
from fedcomp.privacy.release import RELEASED_ROUND_COLUMNS

pytestmark = pytest.mark.slow


def _simulate(cfg, nodes=3):
    from server.simulation import simulate

    return simulate(cfg, num_supernodes=nodes)


def _rows(path):
    with open(path) as handle:
        return list(csv.DictReader(handle))


def test_client_level_dp_records_epsilon_releases_only_what_it_may_and_stops_at_the_target(
        tmp_path):
    cfg = RunConfig(num_server_rounds=3, local_steps=2, local_epochs=0, dp="client",
                    dp_noise_multiplier=1.0, dp_clip_norm=0.5, dp_target_epsilon=50.0,
                    codec="topk:ratio=0.05|quant:bits=4", results_dir=str(tmp_path),
                    run_name="dp")
    summary, _ = _simulate(cfg)
    epsilons = [float(r["epsilon"]) for r in _rows(tmp_path / "dp" / "rounds.csv")]
    assert summary["rounds_completed"] == len(epsilons) >= 1
    assert all(b > a for a, b in itertools.pairwise(epsilons))
    assert summary["epsilon"] == pytest.approx(epsilons[-1]) and summary["epsilon"] <= 50.0
    assert summary["dp_noise"] == "os-entropy" and summary["dp_accountant"] == "pld"
    assert not (tmp_path / "dp" / "clients.csv").exists()
    released = _rows(tmp_path / "dp" / "release" / "rounds.csv")
    assert list(released[0]) == list(RELEASED_ROUND_COLUMNS) and len(released) == len(epsilons)
    assert "uplink_bytes" not in json.loads(
        (tmp_path / "dp" / "release" / "summary.json").read_text())
    # A target epsilon stops a run early: end to end in the sample-level test below,
    # for client level in tests/privacy/test_server.py.


def test_two_dp_runs_with_one_seed_draw_different_noise(tmp_path):
    """The noise is secret by default: the same seed does not give the same model.
    (That dp-reproducible-noise repeats and is labelled NOT PRIVATE is
    tests/privacy/test_server.py's.)"""
    cfg = RunConfig(num_server_rounds=2, local_steps=2, local_epochs=0, dp="client",
                    dp_noise_multiplier=1.0, dp_clip_norm=0.5, feedback="none",
                    codec="quant:bits=8", results_dir=str(tmp_path))
    models = {}
    for label in ("a", "b"):
        _, strategy = _simulate(cfg.replace(run_name=label))
        models[label] = strategy.broadcaster.model
    assert not np.array_equal(models["a"]["fc1.weight"], models["b"]["fc1.weight"])
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["dp_noise"] == \
        "os-entropy"


@pytest.mark.parametrize("mode", ["client-adaptive-subspace", "sample"])
def test_each_dp_mode_completes_two_compressed_rounds(tmp_path, mode):
    # Seeded noise: with 3 clients the count's noise could shrink C by chance; this
    # checks the mechanics, test_two_dp_runs... checks that the default noise is secret.
    extra = (dict(dp="client", dp_adaptive_clip=True, dp_clip_norm=0.05, shared_randk=0.1,
                  codec="quant:bits=8", dp_reproducible_noise=True)
             if mode.startswith("client") else
             dict(dp="sample", dp_clip_norm=1.0, codec="topk:ratio=0.05|quant:bits=4"))
    cfg = RunConfig(num_server_rounds=2, local_steps=4, local_epochs=0,
                    dp_noise_multiplier=1.0, results_dir=str(tmp_path), run_name=mode, **extra)
    summary, _ = _simulate(cfg)
    rows = _rows(tmp_path / mode / "rounds.csv")
    assert summary["rounds_completed"] == 2
    assert sum(int(r["clients_ok"]) for r in rows) == 6
    epsilons = [float(r["epsilon"]) for r in rows]
    assert 0 < epsilons[0] < epsilons[1] == pytest.approx(summary["epsilon"])
    if mode.startswith("client"):
        # C = 0.05 is far below these update norms: every client is clipped, C grows.
        assert float(rows[0]["dp_clip"]) == pytest.approx(0.05)
        assert summary["dp_final_clip"] > 0.05
    else:
        # With a target just above round 1's epsilon, the server stops before round 2.
        tight, _ = _simulate(cfg.replace(run_name="tight", num_server_rounds=3,
                                         dp_target_epsilon=epsilons[0] * 1.01))
        assert tight["rounds_completed"] == 1
        assert "stopped before round 2" in tight["stopped_early"]
        assert tight["epsilon"] <= epsilons[0] * 1.01


# Sample level: the clients' own check, through the query before round 1. The server's
# checks (client level) are tests/privacy/test_server.py's.
@pytest.mark.parametrize(("dp", "key"), [("sample", "dp-delta")])
def test_an_impossible_privacy_setting_stops_the_run_before_round_one(tmp_path, dp, key):
    bad = {"dp-delta": dict(dp_delta=0.5), "dp-target-epsilon": dict(dp_target_epsilon=0.01)}
    cfg = RunConfig(num_server_rounds=2, local_steps=1, local_epochs=0, dp=dp,
                    results_dir=str(tmp_path), run_name="bad", **bad[key])
    with pytest.raises(Exception, match=f"'{key}'"):
        _simulate(cfg)
    assert _rows(tmp_path / "bad" / "rounds.csv") == []
