"""Experiment scripts run end to end on small inputs and write what they promise."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_codec_benchmark_writes_one_row_per_spec_with_the_documented_keys(tmp_path, capsys):
    bench = _load("bench_codecs")
    out = tmp_path / "rows.json"
    assert bench.main(["--quick", "--no-cnn", "--repeats", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    keys = {"spec", "n", "bytes", "bits_per_param", "ratio_vs_fp32", "bits_per_index",
            "encode_s", "decode_s", "rel_l2_error"}
    assert all(keys <= set(row) for row in rows)
    specs = [row["spec"] for row in rows]
    assert {"none", "zstd:level=1", "fp16", "baseline:torch.topk"} <= set(specs)
    by_spec = {row["spec"]: row for row in rows}
    # Sizes are the real payload lengths: fp32 costs 4 bytes per value plus framing.
    assert by_spec["none"]["bytes"] > 4 * by_spec["none"]["n"]
    assert by_spec["none"]["rel_l2_error"] == 0.0
    assert by_spec["fp16"]["bits_per_index"] is None
    assert 8.0 < by_spec["topk:ratio=0.01"]["bits_per_index"] < 9.0
    assert "Targets for" in capsys.readouterr().out


def test_support_overlap_measures_shares_of_the_compressed_energy(capsys):
    overlap = _load("support_overlap")
    own, own_double, on_support, support_plus = overlap.main(
        ["--dataset", "digits", "--rounds", "4", "--skip", "1", "--clients", "5",
         "--per-round", "3"])
    assert 0.0 < on_support < 1.0 and 0.0 < own < own_double <= 1.0
    # S plus a third of the client's own Top-K can only add to S alone.
    assert support_plus > on_support
    assert "own top-0.3%" in capsys.readouterr().out


def test_index_bits_compares_rice_and_rows_coding_on_client_updates(capsys):
    bits = _load("index_bits").main(["--dataset", "digits", "--rounds", "2", "--at", "2",
                                     "--clients", "5", "--per-round", "2"])
    assert bits, "at least one tensor measured"
    for value in bits.values():
        # Allowing rows coding never costs more than Rice alone; nothing beats the
        # row-conditional bound by more than rounding to whole bytes.
        assert value["now"] <= value["before"]
        assert value["now"] >= value["bound"] - 0.5
    assert "rows won" in capsys.readouterr().out


def test_signal_alignment_compares_compressed_means_with_the_population_mean(capsys):
    alignment = _load("signal_alignment")
    common = ["--dataset", "digits", "--rounds", "3", "--at", "2", "3", "--clients", "6",
              "--codec", "none", "--codec", "topk:ratio=0.01|ternary:mode=mean"]
    partial = alignment.main([*common, "--per-round", "3"])
    assert sorted(partial) == [2, 3]
    for row in partial.values():
        # A lossless codec's mean is the sampled mean; a 1% Top-K's is not, and costs less.
        assert abs(row["none cos_sampled"] - 1.0) < 1e-9
        assert abs(row["none cos_population"] - row["cos_sampled_population"]) < 1e-9
        lossy = "topk:ratio=0.01|ternary:mode=mean"
        assert 0.0 < row[f"{lossy} cos_sampled"] < 0.999
        assert row[f"{lossy} kB"] < row["none kB"]
    # Every client sampled: the sampled mean is the population mean.
    full = alignment.main([*common, "--per-round", "6"])
    assert all(abs(row["cos_sampled_population"] - 1.0) < 1e-9 for row in full.values())
    assert "cos population" in capsys.readouterr().out


def test_signal_alignment_cosine_and_weighted_mean():
    alignment = _load("signal_alignment")
    a, b = np.array([1.0, 0.0]), np.array([1.0, 1.0])
    assert abs(alignment.cosine(a, b) - 1 / np.sqrt(2)) < 1e-12
    assert alignment.cosine(a, np.zeros(2)) == 0.0
    mean = alignment.weighted_mean([np.array([0.0]), np.array([3.0])], [2.0, 1.0])
    assert mean.tolist() == [1.0]


def test_uplink_pilot_trains_and_counts_the_payloads_it_sends(tmp_path, capsys):
    pilot = _load("uplink_pilot")
    common = ["--dataset", "digits", "--rounds", "2", "--clients", "4", "--per-round", "2",
              "--eval-every", "1", "--codec", "topk:ratio=0.05|quant:bits=4"]
    curve = pilot.main([*common, "--json", str(tmp_path / "p.json")])
    assert [r for r, _, _ in curve] == [1, 2]
    assert 0.0 <= curve[-1][1] <= 1.0 and 0 < curve[0][2] < curve[1][2]
    assert json.loads((tmp_path / "p.json").read_text())["curve"][-1][0] == 2
    # conv2 in its own payload costs one more envelope; the retrained variant runs.
    split = pilot.main([*common, "--conv2-codec", "fp16", "--retrain-steps", "2",
                        "--feedback", "none"])
    assert split[-1][2] > curve[-1][2]
    # From round 2 the shared support's values travel in a second payload too.
    shared = pilot.main([*common, "--shared-support", "0.5", "--shared-tensors",
                         "conv2.weight"])
    assert shared[0][2] == curve[0][2] and shared[1][2] > curve[1][2]
    # The random-support control and the shared codec's error feedback run too.
    control = pilot.main([*common, "--shared-support", "0.5", "--shared-tensors",
                          "conv2.weight", "--shared-codec", "sign", "--shared-feedback",
                          "--shared-random"])
    assert control[1][2] > curve[1][2]
    # The support of the server's steps over a window of rounds: from round 3 on it is
    # the union of two rounds' supports, so the sign payload on it is not smaller.
    steps = [*common[:3], "3", *common[4:], "--shared-support", "0.02", "--shared-codec",
             "sign", "--shared-tensors", "conv2.weight", "--shared-source", "step"]
    one = pilot.main(steps)
    two = pilot.main([*steps, "--shared-window", "2", "--json", str(tmp_path / "w.json")])
    assert one[1][2] == two[1][2] and two[2][2] - two[1][2] > one[2][2] - one[1][2]
    assert json.loads((tmp_path / "w.json").read_text())["curve"] == [list(c) for c in two]
    with pytest.raises(SystemExit, match="shared-window"):
        pilot.main([*steps, "--shared-window", "0"])
    # A compressed downlink: each sampled client is sent what it missed, never more than
    # the full model (three of them in mean mode with FedAdam: the moments travel too).
    down = [*common[:3], "4", *common[4:], "--server-optimizer", "adam", "--server-lr",
            "0.01", "--downlink-codec", "topk:ratio=0.05|quant:bits=4"]
    full_down = pilot.main(down[:-2])
    for mode in ("step", "mean"):
        sent = pilot.main([*down, "--downlink-mode", mode])
        assert [len(p) for p in sent] == [4] * 4
        # Round 1 trains from the initial model either way; later rounds from the replica.
        assert sent[0][2] == full_down[0][2]
        downlink = [p[3] for p in sent]
        assert 0 < downlink[1] < downlink[3] and downlink == sorted(downlink)
    # catchup: one payload a sampled client, whatever it missed; a lossless codec sends
    # the whole difference, so every round costs the same, the model's size a client.
    lossless = pilot.main([*down[:-1], "none", "--downlink-mode", "catchup"])
    steps = np.diff([0] + [p[3] for p in lossless])
    assert len(set(steps.tolist())) == 1 and lossless[0][2] == full_down[0][2]
    lossy = pilot.main([*down, "--downlink-mode", "catchup"])
    assert 0 < lossy[-1][3] < lossless[-1][3] / 4
    assert "best accuracy" in capsys.readouterr().out


def test_retraining_moves_only_the_support_and_keeps_the_rest_for_the_memory():
    pilot = _load("uplink_pilot")
    from fedcomp.data import load_dataset
    from fedcomp.models import build_model
    from fedcomp.training import state_arrays

    data, _ = load_dataset("digits")
    model = build_model("digits", seed=0)
    start = state_arrays(model)
    rng = np.random.default_rng(0)
    trained = {k: v + 0.01 * rng.standard_normal(v.shape).astype(np.float32)
               for k, v in start.items()}
    masks = {"conv2.weight": rng.random(start["conv2.weight"].shape) < 0.1}
    delta = pilot._retrain_on_support(model, start, trained, masks, data, steps=3, seed=1)
    mask = masks["conv2.weight"]
    first_pass = trained["conv2.weight"] - start["conv2.weight"]
    # Off the support: exactly the first pass's delta (for error feedback to keep).
    np.testing.assert_array_equal(delta["conv2.weight"][~mask], first_pass[~mask])
    # On it: retrained, so no longer the first pass's values.
    assert not np.allclose(delta["conv2.weight"][mask], first_pass[mask])
    # The model itself moved only on the support.
    after = state_arrays(model)["conv2.weight"]
    np.testing.assert_array_equal(after[~mask], start["conv2.weight"][~mask])


def test_offline_averages_agree_with_their_definitions():
    averaging = _load("average_offline")
    from fedcomp.averaging import ModelAverage

    rng = np.random.default_rng(0)
    models = [{"w": rng.normal(size=(3, 4)).astype(np.float32)} for _ in range(9)]
    uniform = [np.mean([m["w"] for m in models[1:r + 1]], axis=0) for r in range(1, 9)]
    # poly:0 and tail:1 are both the uniform average of every model since round 1.
    for scheme in ("poly:0", "tail:1"):
        got = [v["w"] for v in averaging.averages(models, scheme)]
        np.testing.assert_allclose(got, uniform, rtol=1e-5, atol=1e-6)
    # tail:0.5 at round 8 averages rounds 5-8; unwanted rounds are skipped.
    tail = list(averaging.averages(models, "tail:0.5", wanted={8}))
    assert tail[:7] == [None] * 7
    np.testing.assert_allclose(tail[7]["w"], np.mean([m["w"] for m in models[5:9]], axis=0),
                               rtol=1e-5, atol=1e-6)
    # A larger eta forgets the early models faster.
    poly3 = [v["w"] for v in averaging.averages(models, "poly:3")]
    assert np.abs(poly3[-1] - models[-1]["w"]).sum() < np.abs(uniform[-1] - models[-1]["w"]).sum()
    # ema:D is what the server runs, bit for bit; raw is the model itself.
    server = ModelAverage(0.9, models[0])
    for model, replayed in zip(models[1:], averaging.averages(models, "ema:0.9"), strict=True):
        server.update(model)
        np.testing.assert_array_equal(replayed["w"], server.value["w"])
    assert [v["w"] is m["w"] for v, m in zip(averaging.averages(models, "raw"), models[1:],
                                              strict=True)] == [True] * 8
    with pytest.raises(ValueError, match="unknown scheme"):
        next(averaging.averages(models, "swa"))


def test_dp_benchmark_calibrates_each_epsilon_with_the_accountant_runs_report():
    from fedcomp.privacy.accounting import epsilon_of

    dp = _load("dp_tradeoff")
    sweep, accounting = dp.build_sweep("client", [4.0, 8.0], 1000)
    names = [m["name"] for m in sweep.methods]
    assert names[0].startswith("non-private") and len(names) == 1 + 2 * 2
    for run in sweep.runs:
        if run.values["method"] in accounting:
            rate, steps, sigma = accounting[run.values["method"]]
            assert (rate, steps) == (0.1, 100) and run.config.dp == "client"
            eps = run.config.dp_target_epsilon
            assert epsilon_of([(sigma, rate, steps)], 1e-5) <= eps  # never above the target
            assert epsilon_of([(sigma * 0.97, rate, steps)], 1e-5) > eps * 0.99  # and tight
    assert "[[method]]" in dp.to_toml(sweep) and "shared-randk = 0.1" in dp.to_toml(sweep)
