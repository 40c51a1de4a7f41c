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


def test_budget_benchmark_fits_every_payload_in_its_budget(tmp_path, capsys):
    bench = _load("bench_budget")
    out = tmp_path / "rows.json"
    assert bench.main(["--rounds", "2", "--task", "mnist1d", "--budget", "100x",
                       "--budget", "0.5bpp", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(row["budget"], row["values"], row["wire_header"]) for row in rows] == [
        (budget, values, form) for budget in ("100x", "0.5bpp")
        for values in ("auto", "ternary") for form in ("json", "predicted")]
    for json_row, predicted_row in zip(rows[::2], rows[1::2], strict=True):
        # The predicted header is smaller; the budget spends the difference on values.
        assert (predicted_row["framing_and_header_bytes"]
                < json_row["framing_and_header_bytes"])
    for row in rows:
        assert row["parameters"] == 18_826 and row["tensors"] == 31
        assert 0.9 < row["spent"] <= row["max_spent"] <= 1.0  # never above the budget
        assert 0 < row["framing_and_header_bytes"] < row["payload_bytes"]
        assert 0 < row["tensors_sent"] <= 31 and row["encode_s"] > 0
    assert "tensors sent" in capsys.readouterr().out


def test_budget_benchmark_refuses_a_budget_a_run_would_refuse(tmp_path, capsys):
    bench = _load("bench_budget")
    from fedcomp.config import RunConfig
    from fedcomp.errors import SpecError
    from fedcomp.tasks.models import model_shapes

    out = tmp_path / "rows.json"
    assert bench.main(["--rounds", "2", "--task", "mnist1d", "--budget", "1000x",
                       "--values", "ternary", "--wire-header", "json", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["refused"] and row["budget_bytes"] < row["smallest_budget_bytes"]
    assert "payload_bytes" not in row  # nothing was encoded
    with pytest.raises(SpecError, match=f"use at most '{row['largest_factor']}x'"):
        RunConfig.from_mapping({"preset": "fedcomp-budget", "uplink-budget": "1000x",
                                "wire-header": "json"}).check_budgets(model_shapes("mnist1d"))
    assert f"({row['largest_factor']}x)" in capsys.readouterr().out


def test_offline_averages_agree_with_their_definitions():
    averaging = _load("average_offline")
    from fedcomp.federated.averaging import ModelAverage

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


def test_scale_benchmark_holds_what_was_sent_not_a_model_per_client():
    scale = _load("scale")
    from fedcomp.codecs.policy import CompressionPolicy

    rng = np.random.default_rng(0)
    model = {"w": rng.standard_normal((64, 64)).astype(np.float32),
             "b": rng.standard_normal(64).astype(np.float32)}
    policy = CompressionPolicy("topk:ratio=0.08|quant:bits=4", min_numel=1024)
    row = scale.measure(model, policy, clients=200, rounds=6, per_round=10,
                        forget_after=0, seed=0)
    assert row["clients_seen"] == row["clients_held"] > 10
    # Every byte held is a byte sent, and far less than a model per client seen.
    assert row["held_mb"] == pytest.approx(row["sent_mb"])
    assert row["held_mb"] < row["model_per_client_mb"] / 5
    assert row["checkpoint_mb"] > row["held_mb"]
    forgetful = scale.measure(model, policy, clients=200, rounds=6, per_round=10,
                              forget_after=2, seed=0)
    assert forgetful["forgotten"] > 0 and forgetful["held_mb"] < row["held_mb"]


def test_worth_probe_fisher_is_the_mean_squared_minibatch_gradient():
    import torch
    from torch import nn

    probe = _load("budget_worth_probe")
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3)).astype(np.float32)
    y = np.array([0, 1, 1, 0, 1])
    fisher = probe.empirical_fisher(model, x, y, batch_size=2)  # batches of 2, 2, 1
    expected = {"weight": 0.0, "bias": 0.0}
    for start in (0, 2, 4):
        grads = torch.autograd.grad(nn.functional.cross_entropy(
            model(torch.from_numpy(x[start:start + 2])), torch.from_numpy(y[start:start + 2])),
            [model.weight, model.bias])
        for name, grad in zip(("weight", "bias"), grads, strict=True):
            expected[name] += float(grad.pow(2).mean()) / 3
    assert fisher == pytest.approx(expected, rel=1e-6)
    assert model.weight.grad is None or not model.weight.grad.any()  # left clean
    delta = {"weight": np.full((2, 3), 0.5, np.float32), "bias": np.zeros(2, np.float32)}
    start = {"weight": np.full((2, 3), 2.0, np.float32), "bias": np.ones(2, np.float32)}
    weights = probe.measures(delta, fisher, start)
    assert weights["energy"] == {"weight": 1.0, "bias": 1.0}
    assert weights["relative"] == pytest.approx({"weight": 1 / (24 + 1.5), "bias": 1 / 2})
    assert "output" not in weights and "coherence" not in weights
    assert probe.measures(delta, fisher, start, extra={"output": {"weight": 3.0, "bias": 1.0}}
                          )["output"] == {"weight": 3.0, "bias": 1.0}
    assert weights["fisher/ms"]["weight"] == pytest.approx(fisher["weight"] / 0.25)
    assert weights["fisher/ms"]["bias"] == pytest.approx(fisher["bias"])  # all-zero delta
    assert weights["size^-1/2"] == pytest.approx({"weight": 6 ** -0.5, "bias": 2 ** -0.5})
    assert weights["share"]["weight"] == pytest.approx(1 / 1.5)  # 6 entries of 0.5^2


def test_worth_probe_output_gain_is_the_outputs_change_per_unit_of_energy():
    """For a linear layer ``y = W x + b``, an update ``dW`` alone moves the outputs by
    ``dW x`` and ``db`` by ``db`` on every example; an all-zero update gains 1."""
    import torch
    from torch import nn

    probe = _load("budget_worth_probe")
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    start = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 3)).astype(np.float32)
    delta = {"weight": rng.standard_normal((2, 3)).astype(np.float32),
             "bias": np.array([0.5, -1.0], np.float32)}
    gains = probe.output_gain(model, start, delta, x)
    moved = x @ delta["weight"].T.astype(np.float64)
    assert gains["weight"] == pytest.approx(
        np.sum(moved ** 2) / 4 / np.sum(delta["weight"].astype(np.float64) ** 2), rel=1e-5)
    assert gains["bias"] == pytest.approx(1.0, rel=1e-6)
    assert probe.output_gain(model, start, {"bias": np.zeros(2, np.float32)}, x) == {"bias": 1.0}


def test_worth_probe_feedback_keeps_exactly_what_the_budgeted_payload_did_not_carry():
    from fedcomp.codecs.budget import VALUE_CHOICES, TopKFamily
    from fedcomp.codecs.pipeline import Pipeline

    probe = _load("budget_worth_probe")
    rng = np.random.default_rng(3)
    delta = {"w": rng.standard_normal(2000).astype(np.float32),
             "b": rng.standard_normal(20).astype(np.float32)}
    residual = {"w": rng.standard_normal(2000).astype(np.float32),
                "b": np.zeros(20, np.float32)}
    template = Pipeline.parse("topk|ternary:mode=mean")
    families = {k: TopKFamily(template, v.size, VALUE_CHOICES) for k, v in delta.items()}
    shares, kept = probe.send_with_feedback(delta, residual, families, {"w": 1.0, "b": 1.0},
                                            2000.0, rng=np.random.default_rng(0))
    for name in delta:
        compensated = delta[name] + residual[name]
        sent = compensated - kept[name]
        # Exactly the share of entries sent left the residual (Top-K of the compensated
        # update), and nothing else did.
        assert np.count_nonzero(sent) == round(shares[name] * compensated.size)
        untouched = sent == 0
        np.testing.assert_array_equal(kept[name][untouched], compensated[untouched])
    assert 0 < shares["w"] < 0.5  # 2,000 bits cannot carry most of 2,020 entries
    heavier, _ = probe.send_with_feedback(delta, residual, families, {"w": 1.0, "b": 100.0},
                                          2000.0, rng=np.random.default_rng(0))
    assert heavier["b"] >= shares["b"] and heavier["w"] <= shares["w"]


def test_worth_probe_coherence_is_one_for_agreeing_updates_and_falls_as_they_cancel():
    probe = _load("budget_worth_probe")
    same = {"a": np.array([1.0, 2.0], np.float32)}
    assert probe.coherence([same, same]) == {"a": pytest.approx(1.0)}
    opposite = [{"a": np.array([1.0, 0.0], np.float32)}, {"a": np.array([-1.0, 0.0], np.float32)}]
    assert probe.coherence(opposite) == {"a": 0.0}
    orthogonal = [{"a": np.array([1.0, 0.0], np.float32)}, {"a": np.array([0.0, 1.0], np.float32)}]
    assert probe.coherence(orthogonal) == {"a": pytest.approx(0.5)}
    assert probe.coherence([{"z": np.zeros(2, np.float32)}] * 2) == {"z": 1.0}
