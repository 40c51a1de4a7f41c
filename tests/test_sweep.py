"""Sweeps and reports: grids, stable ids, resume, failures, bytes-to-target, plots."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from fedcomp.config import RunConfig
from fedcomp.errors import SpecError
from fedcomp.ops.report import (
    budget_choice_series,
    build_report,
    bytes_to_target,
    current_encoder,
    feedback_series,
    load_runs,
    reference_method,
    write_report,
)
from fedcomp.ops.results import RoundRecord, RunRecorder
from fedcomp.ops.sweep import Sweep, run_sweep

ROOT = Path(__file__).resolve().parents[1]


def _sweep(**grid) -> Sweep:
    return Sweep(base={"num-server-rounds": 3},
                 grid=grid or {"codec": ["none", "sign"], "seed": [0, 1]})


def fake_runner(accuracy_by_codec: dict[str, list[float]], calls: list, fail_on=()):
    """Writes results like a real run: rounds.csv and summary.json via RunRecorder."""

    def runner(cfg: RunConfig, num_supernodes: int) -> dict:
        calls.append((cfg.run_name, cfg.resume))
        if (cfg.codec, cfg.seed) in fail_on:
            raise RuntimeError(f"boom in {cfg.codec}")
        recorder = RunRecorder(Path(cfg.results_dir) / cfg.run_name, cfg.describe(),
                               model_bytes=1000, num_rounds=cfg.num_server_rounds,
                               verbose=False)
        up = 1000 if cfg.codec == "none" else 50
        for rnd, acc in enumerate(accuracy_by_codec[cfg.codec], 1):
            recorder.record(RoundRecord(rnd, accuracy=acc + 0.001 * cfg.seed, uplink_bytes=up,
                                        downlink_bytes=1000, clients_ok=1))
        return recorder.finish()

    return runner


ACC = {"none": [0.5, 0.8, 0.9], "sign": [0.3, 0.6, 0.85]}


def test_grid_expands_to_the_cartesian_product_with_stable_ids():
    sweep = _sweep()
    assert [r.values for r in sweep.runs] == [
        {"codec": "none", "seed": 0}, {"codec": "none", "seed": 1},
        {"codec": "sign", "seed": 0}, {"codec": "sign", "seed": 1}]
    assert [r.run_id for r in sweep.runs] == [r.run_id for r in _sweep().runs]
    assert len({r.run_id for r in sweep.runs}) == 4
    other = Sweep(base={"num-server-rounds": 4}, grid={"codec": ["none", "sign"],
                                                         "seed": [0, 1]})
    assert not {r.run_id for r in other.runs} & {r.run_id for r in sweep.runs}


def test_methods_times_grid_and_bad_sweeps_are_refused():
    sweep = Sweep(base={}, grid={"seed": [0, 1]},
                  methods=[{"name": "a", "codec": "sign"},
                           {"name": "b", "codec": "none", "feedback": "none"}])
    # Every method on the first seed before any on the second.
    assert [r.values for r in sweep.runs] == [
        {"method": "a", "seed": 0}, {"method": "b", "seed": 0},
        {"method": "a", "seed": 1}, {"method": "b", "seed": 1}]
    assert sweep.runs[1].config.feedback == "none" and sweep.runs[0].config.feedback == "ef"
    with pytest.raises(SpecError, match="non-empty list"):
        Sweep(base={}, grid={"seed": 3})
    with pytest.raises(SpecError, match="unknown run config key"):
        Sweep(base={"codecs": "sign"}, grid={})
    with pytest.raises(SpecError, match="set by the sweep itself"):
        Sweep(base={"run-name": "x"}, grid={})
    assert len(Sweep.load(ROOT / "experiments/sweeps/headline.toml").runs) == 46  # 23 x 2
    held_out = Sweep.load(ROOT / "experiments/sweeps/held_out_seeds.toml").runs
    assert len(held_out) == 8
    # Its seeds 0 and 1 are the headline's runs (saving models is not part of the id).
    headline_ids = {r.run_id for r in Sweep.load(ROOT / "experiments/sweeps/headline.toml").runs}
    assert {r.run_id for r in held_out if r.values["seed"] in (0, 1)} <= headline_ids


def test_a_sweep_names_each_methods_notices_once_before_its_runs():
    budgeted = {"uplink-budget": "400x", "downlink-budget": "40x",
                "budget-values": "codec", "codec": "topk|ternary:mode=mean"}
    sweep = Sweep(base=budgeted, grid={"seed": [0, 1, 2]},
                  methods=[{"name": "bare down", "downlink-codec": "topk"},
                           {"name": "4-bit down", "downlink-codec": "topk|quant:bits=4"}])
    assert len(sweep.notices) == 1
    assert sweep.notices[0].startswith("bare down: run config 'downlink-codec' = 'topk'")


def test_an_interrupted_sweep_reruns_only_the_missing_runs(tmp_path):
    sweep, calls = _sweep(), []
    interrupted = []

    def dies_on_third(cfg, n):
        if len(interrupted) == 2:
            raise KeyboardInterrupt  # the user pressed Ctrl-C: the sweep stops
        interrupted.append(cfg.run_name)
        return fake_runner(ACC, calls)(cfg, n)

    with pytest.raises(KeyboardInterrupt):
        run_sweep(sweep, tmp_path, dies_on_third, log=lambda _: None)
    # A run that got as far as a checkpoint is resumed, not restarted.
    (tmp_path / sweep.runs[2].run_id).mkdir()
    (tmp_path / sweep.runs[2].run_id / "checkpoint.npz").write_bytes(b"")
    calls.clear()
    rows = run_sweep(sweep, tmp_path, fake_runner(ACC, calls), log=lambda _: None)
    assert [name for name, _ in calls] == [r.run_id for r in sweep.runs[2:]]
    assert [resume for _, resume in calls] == [True, False]
    assert [r["status"] for r in rows] == ["complete"] * 4


def test_a_failing_run_is_recorded_and_the_sweep_goes_on(tmp_path):
    calls = []
    rows = run_sweep(_sweep(), tmp_path, fake_runner(ACC, calls, fail_on={("sign", 0)}),
                     log=lambda _: None)
    assert [r["status"] for r in rows] == ["complete", "complete", "failed", "complete"]
    assert "boom in sign" in rows[2]["error"]
    with open(tmp_path / "runs.csv") as handle:
        on_disk = list(csv.DictReader(handle))
    assert list(on_disk[0])[:4] == ["run_id", "status", "codec", "seed"]
    assert on_disk[2]["status"] == "failed" and "boom" in on_disk[2]["error"]
    assert (tmp_path / rows[2]["run_id"] / "error.txt").exists()


def test_bytes_to_target_on_a_hand_made_rounds_file():
    rounds = [
        {"round": 1, "accuracy": 0.50, "cum_uplink_bytes": 100, "cum_downlink_bytes": 1000},
        {"round": 2, "accuracy": 0.84, "cum_uplink_bytes": 200, "cum_downlink_bytes": 2000},
        {"round": 3, "accuracy": 0.86, "cum_uplink_bytes": 300, "cum_downlink_bytes": 3000},
        {"round": 4, "accuracy": 0.90, "cum_uplink_bytes": 400, "cum_downlink_bytes": 4000},
    ]
    assert bytes_to_target(rounds, 0.85) == (3, 300, 3300)
    assert bytes_to_target(rounds, 0.84) == (2, 200, 2200)  # reaching it exactly counts
    assert bytes_to_target(rounds, 0.95) is None
    # eval-every > 1: rounds without an evaluation (NaN) never count as reaching it.
    sparse = [dict(r, accuracy=float("nan")) if r["round"] % 2 else r for r in rounds]
    assert bytes_to_target(sparse, 0.85) == (4, 400, 4400)


def test_a_run_that_scores_the_printed_target_reaches_it():
    """FedAvg's best 0.9019 and 0.8951 make the target 0.8885 (not 0.8885000000000001)."""
    from fedcomp.ops.report import RunResult

    def run(run_id, seed, method, accuracies):
        rounds = [{"round": i, "accuracy": a, "cum_uplink_bytes": 10 * i,
                   "cum_downlink_bytes": 10 * i} for i, a in enumerate(accuracies, 1)]
        config = {"codec": "none"} if method == "FedAvg" else {"codec": "sign"}
        return RunResult(run_id, {"method": method, "seed": seed}, rounds,
                         {"config": config, "best_accuracy": max(accuracies)})

    runs = [run("a", 0, "FedAvg", [0.85, 0.9019]), run("b", 1, "FedAvg", [0.85, 0.8951]),
            run("c", 0, "sign", [0.8884, 0.8885]), run("d", 1, "sign", [0.8885, 0.80])]
    target, methods = build_report(runs)
    assert f"{target:.4f}" == "0.8885"
    sign = next(m for m in methods if m.method == "sign")
    assert sign.round_to_target == [2, 1]


def test_report_computes_factors_against_the_uncompressed_runs_and_draws_plots(tmp_path):
    run_sweep(_sweep(), tmp_path, fake_runner(ACC, []), log=lambda _: None)
    target, methods = build_report(load_runs(tmp_path))
    # Target: mean best accuracy of the codec=none runs (0.9, 0.901) minus one point.
    assert target == pytest.approx(0.9005 - 0.01)
    by_name = {m.method: m for m in methods}
    assert by_name["codec=none"].uplink_to_target == [3000, 3000]   # round 3
    assert by_name["codec=sign"].uplink_to_target == [None, None]   # best 0.85 < 0.89
    table, paths = write_report(tmp_path, target=0.8)
    assert "| codec=sign | 2 |" in table
    sign_row = next(line for line in table.splitlines() if line.startswith("| codec=sign"))
    assert sign_row.split("|")[7].strip() == "13.3"  # to 0.8: 2000 (round 2) vs 150 (round 3)
    assert all(p.exists() and p.stat().st_size > 1000 for p in paths)
    assert json.loads((tmp_path / "sweep.json").read_text())["columns"] == ["codec", "seed"]


def test_the_plots_draw_only_the_methods_named_each_in_its_own_style(tmp_path):
    from fedcomp.ops.report import _line_style, select_methods

    run_sweep(_sweep(), tmp_path, fake_runner(ACC, []), log=lambda m: None)
    _, methods = build_report(load_runs(tmp_path), 0.8)
    assert [m.method for m in select_methods(methods, ["codec=sign"])] == ["codec=sign"]
    assert select_methods(methods, []) == methods
    with pytest.raises(ValueError, match=r"no method named 'fedavg'.*codec=none"):
        select_methods(methods, ["fedavg"])
    _, paths = write_report(tmp_path, target=0.8, plot_methods=["codec=none"])
    assert all(p.exists() for p in paths)
    styles = {tuple(sorted((k, str(v)) for k, v in _line_style(i).items()
                           if k in ("color", "ls"))) for i in range(40)}
    assert len(styles) == 40


def test_complete_runs_from_another_encoder_are_reported_not_rerun(tmp_path):
    """The run id covers the config; the recorded encoder covers the code."""
    calls, messages = [], []
    plain = fake_runner(ACC, calls)

    def records_encoder(cfg, n):
        plain(cfg, n)
        summary_path = Path(cfg.results_dir) / cfg.run_name / "summary.json"
        summary = json.loads(summary_path.read_text())
        summary["encoder"] = f"v1-{cfg.codec}"
        summary_path.write_text(json.dumps(summary))
        return summary

    sweep = _sweep()
    run_sweep(sweep, tmp_path, records_encoder, log=lambda _: None)
    # The code changed how "sign" encodes: those runs are named, and none reruns.
    calls.clear()
    rows = run_sweep(sweep, tmp_path, plain, log=messages.append,
                     fingerprint=lambda cfg: "v2-sign" if cfg.codec == "sign" else
                     f"v1-{cfg.codec}")
    assert calls == []
    warned = [m for m in messages if "warning" in m]
    assert len(warned) == 2 and all("v1-sign" in m and "v2-sign" in m for m in warned)
    assert {r["encoder"] for r in rows} == {"v1-none", "v1-sign"}
    assert "encoder" in (tmp_path / "runs.csv").read_text().splitlines()[0]
    # Runs of different codecs always fingerprint differently: that alone is no warning.
    table, _ = write_report(tmp_path, target=0.8)
    assert not table.startswith("Note")
    # Checked against the current code, the report names the runs it would encode anew.
    table, _ = write_report(tmp_path, target=0.8, fingerprint=lambda config: (
        "v2-sign" if config["codec"] == "sign" else f"v1-{config['codec']}"))
    first = table.splitlines()[0]
    assert first.startswith("Note: of these 4 runs, 2 runs were encoded by other code")
    assert "codec=sign: 2" in first and "codec=none" not in first
    # Without the current code's view, two encoders within one method are still caught.
    sign_run = next(r["run_id"] for r in rows if r["codec"] == "sign")
    summary_path = tmp_path / sign_run / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary["encoder"] = "v0-sign"
    summary_path.write_text(json.dumps(summary))
    first = write_report(tmp_path, target=0.8)[0].splitlines()[0]
    assert "more than one encoder within one method (codec=sign: 2)" in first


def test_the_report_of_unrecorded_runs_says_so_and_of_current_ones_says_nothing(tmp_path):
    run_sweep(_sweep(), tmp_path, fake_runner(ACC, []), log=lambda _: None)
    table, _ = write_report(tmp_path, target=0.8)
    assert table.startswith("Note: of these 4 runs, 4 runs record no encoder")
    for run_dir in tmp_path.glob("*/summary.json"):
        summary = json.loads(run_dir.read_text())
        summary["encoder"] = current_encoder(summary["config"])
        run_dir.write_text(json.dumps(summary))
    table, _ = write_report(tmp_path, target=0.8, fingerprint=current_encoder)
    assert not table.startswith("Note")


def test_current_encoder_is_the_run_configs_fingerprint_and_empty_for_old_configs():
    from fedcomp.tasks.models import model_shapes

    config = RunConfig(dataset="digits", codec="topk:ratio=0.1|ternary:mode=mean",
                       downlink_codec="topk:ratio=0.1|quant:bits=4", wire_header="json")
    expected = config.encoder_fingerprint(model_shapes("digits"))
    assert current_encoder(config.describe()) == expected  # the *-config keys are ignored
    assert current_encoder(config.replace(seed=7).describe()) == expected
    assert current_encoder(config.replace(codec="sign").describe()) != expected
    assert current_encoder({**config.to_mapping(), "codec": "no-such-codec"}) == ""
    # The header form changes the payloads, so the fingerprint, computed after one of
    # the same codecs in the other form (the fingerprints are cached by policy).
    predicted = config.replace(wire_header="predicted")
    assert current_encoder(predicted.describe()) == predicted.encoder_fingerprint(
        model_shapes("digits")) != expected
    # A run recorded before the setting existed ran with the JSON header, today's
    # default or not: its record, which lacks the key, is read that way.
    recorded = {k: v for k, v in predicted.describe().items() if k != "wire-header"}
    assert current_encoder(recorded) == expected


@pytest.mark.slow
def test_smoke_sweep_through_the_command_line(tmp_path, capsys):
    from fedcomp.ops.cli import main

    out = tmp_path / "smoke"
    # Each run goes through `flwr run` on the local SuperLink, as `make run` does.
    command = ["sweep", str(ROOT / "experiments/sweeps/smoke.toml"), "--out", str(out),
               "--app", str(ROOT)]
    assert main(command) == 0
    # A line per run and per round; Flower's INFO lines and deprecation notes held back.
    console = capsys.readouterr().out
    assert "[run 1/2]" in console and "[run 2/2]" in console
    assert console.count("[round ") == 4, console
    assert "INFO" not in console and "deprecated" not in console.lower(), console
    with open(out / "runs.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["status"] for r in rows] == ["complete", "complete"]
    assert int(rows[0]["uplink_bytes"]) >= 50 * int(rows[1]["uplink_bytes"])
    assert main(["report", str(out), "--target", "0.1"]) == 0
    assert (out / "accuracy_vs_uplink.png").exists() and (out / "accuracy_vs_round.png").exists()
    # A second sweep over the same folder has nothing left to do.
    assert main(command) == 0


def test_only_plain_fedavg_sets_the_target_and_the_reference(tmp_path):
    """An uncompressed run with another server optimizer, or whose server averages its
    models, is a method, not the baseline."""
    acc = {"none": [0.5, 0.8, 0.9], "sign": [0.3, 0.6, 0.85]}
    sweep = Sweep(base={"num-server-rounds": 3, "seed": 0}, grid={},
                  methods=[{"name": "FedAvg", "codec": "none"},
                           {"name": "FedAdam", "codec": "none", "server-optimizer": "adam",
                            "server-lr": 0.01},
                           {"name": "FedAvg averaged", "codec": "none",
                            "server-average": 0.9},
                           {"name": "sign", "codec": "sign"}])

    def runner(cfg: RunConfig, num_supernodes: int) -> dict:
        recorder = RunRecorder(Path(cfg.results_dir) / cfg.run_name, cfg.describe(),
                               model_bytes=1000, num_rounds=3, verbose=False)
        # FedAdam is better than FedAvg: were it a baseline, the target would rise and
        # the factors would be taken against its bytes.
        better = cfg.server_optimizer == "adam" or cfg.server_average > 0
        curve = [0.85, 0.95, 0.99] if better else acc[cfg.codec]
        for rnd, a in enumerate(curve, 1):
            recorder.record(RoundRecord(rnd, accuracy=a, clients_ok=1,
                                        uplink_bytes=1000 if cfg.codec == "none" else 50,
                                        downlink_bytes=1000))
        return recorder.finish()

    run_sweep(sweep, tmp_path, runner, log=lambda _: None)
    target, _ = build_report(load_runs(tmp_path))
    assert target == pytest.approx(0.9 - 0.01)
    table, _ = write_report(tmp_path, target=0.8)
    first_table = table[:table.index("Whole runs")]
    rows = {line.split("|")[1].strip(): line.split("|") for line in first_table.splitlines()
            if line.startswith("| ") and not line.startswith("| method")}
    assert rows["FedAvg"][7].strip() == "1.0"
    # To 0.8 FedAvg needs 2 rounds (2000 bytes), FedAdam 1 (1000: 2.0x) and sign 3
    # (150 bytes): 13.3x against FedAvg; against FedAdam it would read 6.7x.
    assert rows["FedAdam"][7].strip() == "2.0"
    assert rows["FedAvg averaged"][7].strip() == "2.0"
    assert rows["sign"][7].strip() == "13.3"

    # Any method can be named the reference (the strongest fp32 baseline at no extra
    # bytes, say): its factors come first, plain FedAvg's beside them.
    table, _ = write_report(tmp_path, target=0.8, reference="FedAvg averaged")
    first_table = table[:table.index("Whole runs")]
    assert "uplink x vs FedAvg | total x vs FedAvg |" in first_table
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[7:11]]
            for line in first_table.splitlines()
            if line.startswith("| ") and not line.startswith("| method")}
    # To 0.8: averaged 1000 up / 2000 in all, FedAvg 2000 / 4000, sign 150 / 3150.
    assert rows["sign"] == ["6.7", "0.6", "13.3", "1.3"]
    assert rows["FedAvg"] == ["0.5", "0.5", "1.0", "1.0"]


def _curve_runner(curve):
    """A runner that records ``curve(cfg)`` as a run's accuracy, round by round, with
    1000 uplink bytes a round uncompressed (50 compressed) and 1000 down."""
    def runner(cfg: RunConfig, num_supernodes: int) -> dict:
        recorder = RunRecorder(Path(cfg.results_dir) / cfg.run_name, cfg.describe(),
                               model_bytes=1000, num_rounds=3, verbose=False)
        for rnd, a in enumerate(curve(cfg), 1):
            recorder.record(RoundRecord(rnd, accuracy=a, clients_ok=1,
                                        uplink_bytes=1000 if cfg.codec == "none" else 50,
                                        downlink_bytes=1000))
        return recorder.finish()
    return runner


def test_the_strongest_fp32_reference_is_the_best_method_that_costs_no_extra_bytes(
        tmp_path):
    """``strongest-fp32`` takes the uncompressed, noise-free method with the highest
    mean best accuracy, whatever its server rule or local epochs; a better method that
    compresses a direction or adds DP noise is not a baseline."""
    sweep = Sweep(base={"num-server-rounds": 3}, grid={"seed": [0, 1]},
                  methods=[{"name": "FedAvg", "codec": "none", "downlink-codec": "none"},
                           {"name": "FedAvg averaged, 2 epochs", "codec": "none",
                            "downlink-codec": "none", "server-average": 0.9,
                            "local-epochs": 2},
                           {"name": "FedAdam", "codec": "none", "downlink-codec": "none",
                            "server-optimizer": "adam", "server-lr": 0.01},
                           {"name": "fp32 up, 8-bit down", "codec": "none",
                            "downlink-codec": "quant:bits=8", "server-optimizer": "adam",
                            "server-lr": 0.01},
                           {"name": "sign", "codec": "sign"}])
    # Best accuracy per method and seed: FedAdam 0.93 / 0.95 (mean 0.94) beats the
    # averaged two-epoch FedAvg (0.96 / 0.90, mean 0.93) though not on every seed; the
    # 8-bit downlink and sign would beat both, but they are not fp32 baselines.
    best = {("FedAvg", 0): 0.90, ("FedAvg", 1): 0.88,
            ("FedAvg averaged, 2 epochs", 0): 0.96, ("FedAvg averaged, 2 epochs", 1): 0.90,
            ("FedAdam", 0): 0.93, ("FedAdam", 1): 0.95,
            ("fp32 up, 8-bit down", 0): 0.99, ("fp32 up, 8-bit down", 1): 0.99,
            ("sign", 0): 0.98, ("sign", 1): 0.98}

    def method_of(cfg: RunConfig) -> str:
        if cfg.codec == "sign":
            return "sign"
        if cfg.downlink_codec != "none":
            return "fp32 up, 8-bit down"
        if cfg.server_optimizer == "adam":
            return "FedAdam"
        return "FedAvg averaged, 2 epochs" if cfg.local_epochs == 2 else "FedAvg"

    def curve(cfg: RunConfig) -> list[float]:
        top = best[method_of(cfg), cfg.seed]
        return [top - 0.2, top - 0.05, top]

    run_sweep(sweep, tmp_path, _curve_runner(curve), log=lambda _: None)
    runs = load_runs(tmp_path)
    target, methods = build_report(runs, reference="strongest-fp32")
    assert target == pytest.approx(0.94 - 0.01)
    assert reference_method(methods, "strongest-fp32").method == "FedAdam"
    table, _ = write_report(tmp_path, reference="strongest-fp32")
    assert "Factors against FedAdam, then against FedAvg." in table
    # Without FedAdam the averaged two-epoch FedAvg is the strongest.
    without = [m for m in methods if m.method != "FedAdam"]
    assert reference_method(without, "strongest-fp32").method == "FedAvg averaged, 2 epochs"
    with pytest.raises(ValueError, match="no fp32 baseline"):
        reference_method([m for m in methods if m.method in ("sign", "fp32 up, 8-bit down")],
                         "strongest-fp32")


def test_report_adds_tables_for_extra_targets_and_a_whole_run_table(tmp_path):
    run_sweep(_sweep(), tmp_path, fake_runner(ACC, []), log=lambda _: None)
    table, _ = write_report(tmp_path, extra_targets=[0.8, 0.5])
    targets = [line.split(".", 1)[0] + "." + line.split(".")[1][:4]
               for line in table.splitlines() if line.startswith("Target accuracy")]
    # The default target (0.9005 - 0.01) first, then the extra ones in order.
    assert targets == ["Target accuracy: 0.8905", "Target accuracy: 0.8000",
                       "Target accuracy: 0.5000"]
    whole = table[table.index("Whole runs"):]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in whole.splitlines() if line.startswith("| codec=")}
    # codec=none: 1000 uplink + 1000 downlink bytes per round; sign 50 + 1000.
    assert rows["codec=none"][4:] == ["1.0", "2.0", "1", "1.0"]
    assert rows["codec=sign"][4:] == ["0.1", "1.1", "20", "1.9"]
    # final accuracy: mean of the seeds' last evaluation (0.85 and 0.851)
    assert rows["codec=sign"][:4] == ["2", "3", "0.8505", "0.8505"]
    assert (tmp_path / "report.md").read_text().count("| codec=sign |") == 4


def test_report_tables_accuracy_at_chosen_rounds_as_a_mean_over_seeds(tmp_path):
    run_sweep(_sweep(), tmp_path, fake_runner(ACC, []), log=lambda _: None)
    table, _ = write_report(tmp_path, at_rounds=[2, 3, 4])
    part = table[table.index("Accuracy at chosen rounds"):]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in part.splitlines() if line.startswith("| codec=")}
    # seeds add 0.000 and 0.001: the means are 0.8005 and 0.6005 at round 2; round 4
    # was never run, so it shows '-' rather than a number.
    assert rows == {"codec=none": ["2", "0.8005", "0.9005", "-"],
                    "codec=sign": ["2", "0.6005", "0.8505", "-"]}


@pytest.mark.parametrize("path", sorted((ROOT / "experiments/sweeps").glob("*.toml")),
                         ids=lambda p: p.name)
def test_every_committed_sweep_file_loads_with_valid_configs(path):
    """A sweep file that no longer parses (a renamed key, a bad codec) fails here, not
    an hour into a sweep."""
    sweep = Sweep.load(path)
    assert sweep.runs and len({r.run_id for r in sweep.runs}) == len(sweep.runs)


def test_several_plain_fedavg_methods_need_a_named_reference(tmp_path):
    """FedAvg with more local epochs is plain FedAvg too: the report must not guess."""
    sweep = Sweep(base={"num-server-rounds": 3, "seed": 0}, grid={},
                  methods=[{"name": "FedAvg", "codec": "none"},
                           {"name": "FedAvg, 2 epochs", "codec": "none", "local-epochs": 2},
                           {"name": "sign", "codec": "sign"}])
    curves = {("none", False): [0.5, 0.8, 0.9], ("none", True): [0.7, 0.9, 0.95],
              ("sign", False): [0.3, 0.6, 0.85]}

    run_sweep(sweep, tmp_path,
              _curve_runner(lambda cfg: curves[cfg.codec, cfg.local_epochs == 2]),
              log=lambda _: None)
    runs = load_runs(tmp_path)
    with pytest.raises(ValueError, match=r"'FedAvg', 'FedAvg, 2 epochs'.*--reference"):
        build_report(runs)
    with pytest.raises(ValueError, match="'FedAvg, 4 epochs' is not in this sweep"):
        build_report(runs, reference="FedAvg, 4 epochs")
    target, _ = build_report(runs, reference="FedAvg")
    assert target == pytest.approx(0.9 - 0.01)
    assert build_report(runs, reference="FedAvg, 2 epochs")[0] == pytest.approx(0.95 - 0.01)
    table, _ = write_report(tmp_path, target=0.8, reference="FedAvg")
    first_table = table[:table.index("Whole runs")]
    rows = {line.split("|")[1].strip(): line.split("|") for line in first_table.splitlines()
            if line.startswith("| ") and not line.startswith("| method")}
    # To 0.8: FedAvg 2 rounds (2000 uplink bytes), 2 epochs 2 rounds too, sign 3 (150).
    assert rows["sign"][7].strip() == "13.3"
    assert rows["FedAvg, 2 epochs"][7].strip() == "1.0"


def test_current_encoder_covers_every_setting_of_the_policies():
    # min-numel moves tensors between the main and the small-tensor codec: a run with
    # another threshold encodes differently, so its fingerprint must differ too.
    config = RunConfig(dataset="digits", codec="topk:ratio=0.1|quant:bits=4",
                       small_codec="quant:bits=8")
    assert current_encoder(config.replace(min_numel=10).describe()) != current_encoder(
        config.describe())


def test_paired_table_compares_each_seed_with_the_reference_run_of_that_seed(tmp_path,
                                                                         capsys):
    """Means hide which seeds hold a factor: seed 0's FedAvg is fast, seed 1's slow."""
    sweep = Sweep(base={"num-server-rounds": 3}, grid={"seed": [0, 1, 2]},
                  methods=[{"name": "FedAvg", "codec": "none"},
                           {"name": "sign", "codec": "sign"},
                           # Its seed-1 run fails: that cell says so.
                           {"name": "sign, fp16 biases", "codec": "sign",
                            "small-codec": "fp16"}])
    curves = {("none", 0): [0.9, 0.9, 0.9], ("none", 1): [0.5, 0.6, 0.9],
              ("none", 2): [0.5, 0.6, 0.7],  # never reaches 0.8: its seed is n/a
              ("sign", 0): [0.5, 0.9, 0.9], ("sign", 1): [0.5, 0.9, 0.9],
              ("sign", 2): [0.5, 0.9, 0.9]}

    def runner(cfg: RunConfig, num_supernodes: int) -> dict:
        if cfg.small_codec == "fp16" and cfg.seed == 1:
            raise RuntimeError("this run fails")
        recorder = RunRecorder(Path(cfg.results_dir) / cfg.run_name, cfg.describe(),
                               model_bytes=1000, num_rounds=3, verbose=False)
        for rnd, acc in enumerate(curves[cfg.codec, cfg.seed], 1):
            recorder.record(RoundRecord(rnd, accuracy=acc, clients_ok=1, downlink_bytes=1000,
                                        uplink_bytes=1000 if cfg.codec == "none" else 50))
        return recorder.finish()

    run_sweep(sweep, tmp_path, runner, log=lambda _: None)
    table, _ = write_report(tmp_path, target=0.8, paired=True)
    paired = table[table.index("Paired by seed"):table.index("Whole runs")]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in paired.splitlines() if line.startswith("| ")}
    assert rows["method"] == ["seed 0", "seed 1", "seed 2"]
    # sign reaches 0.8 in round 2 (100 B up, 2,100 B in all) in every seed; FedAvg in
    # round 1 with seed 0 (1,000 / 2,000 B) and round 3 with seed 1 (3,000 / 6,000 B).
    assert rows["sign"] == ["10.0 / 1.0", "30.0 / 2.9", "n/a"]
    assert rows["sign, fp16 biases"] == ["10.0 / 1.0", "not run", "n/a"]
    assert rows["FedAvg"] == ["1.0 / 1.0", "1.0 / 1.0", "n/a"]
    # Without the flag the report is as before.
    assert "Paired by seed" not in write_report(tmp_path, target=0.8)[0]
    # A reference that is not in the sweep is an error naming it, not a traceback.
    from fedcomp.ops.cli import main

    assert main(["report", str(tmp_path), "--paired", "--reference", "FedAvg fp16"]) == 2
    assert "'FedAvg fp16' is not in this sweep" in capsys.readouterr().err


#: Committed run folders (experiments/runs/NAME, made by experiments/sweeps/NAME.toml
#: with "-" for "_"); the attack benchmarks' runs come from fault_tolerance.py instead.
COMMITTED_RUNS = ("headline", "held-out-seeds", "dp-sample", "dp-client", "mnist1d", "budget",
                  "budget-mnist1d", "budget-pilot", "budget-mnist1d-pilot", "budget-mnist1d-long",
                  "feedback-lag", "feedback-lag-fashion", "local-epochs-pilot", "local-epochs")


@pytest.mark.parametrize("folder", COMMITTED_RUNS)
def test_committed_runs_are_what_their_sweep_file_makes(folder):
    """The results page cites these runs: each is a run its sweep file would make (same
    settings, same id), so rerunning the sweep into a copy of the folder skips them."""
    runs_dir = ROOT / "experiments/runs" / folder
    sweep = Sweep.load(ROOT / "experiments/sweeps" / f"{folder.replace('-', '_')}.toml")
    committed = {p.name for p in runs_dir.glob("r-*")}
    assert committed and committed <= {r.run_id for r in sweep.runs}
    for run_id in committed:
        assert (runs_dir / run_id / "rounds.csv").exists()
        assert (runs_dir / run_id / "summary.json").exists()


def test_committed_attack_runs_are_what_the_results_pages_commands_make():
    """experiments/runs/faults-* hold exactly the runs of the results page's commands
    (digits: every defence at seed 0, label flipping on seeds 0-3; Fashion-MNIST: the
    3x bound, the default and the robust rules against one and three attackers in ten
    of each kind, no defence against four)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "fault_tolerance", ROOT / "experiments" / "fault_tolerance.py")
    tolerance = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tolerance)
    every = tolerance.build_sweep("digits", list(tolerance.DEFENCES), tolerance.ATTACKS,
                                  [0.1, 0.3], 10, [0])
    seeds = tolerance.build_sweep("digits", ["default", "clip3x"], ["labelflip"], [0.1], 10,
                                  [0, 1, 2, 3])
    made = {r.run_id for r in every.runs} | {r.run_id for r in seeds.runs}
    committed = {p.name for p in (ROOT / "experiments/runs/faults-digits").glob("r-*")}
    assert committed == made
    # Fashion-MNIST: every attack behind the 3x bound, the default and each robust rule,
    # four attacks without a defence.
    fashion = [tolerance.build_sweep("fashion-mnist", [defence], tolerance.ATTACKS,
                                     [0.1, 0.3], 10, [0]) for defence in ("clip3x", "default")]
    fashion.append(tolerance.build_sweep("fashion-mnist", ["none"],
                                         ["signflip", "scale", "inflate", "labelflip"],
                                         [0.1], 10, [0]))
    fashion.append(tolerance.build_sweep("fashion-mnist", ["median", "trimmed", "krum"],
                                         tolerance.ATTACKS, [0.1], 10, [0]))
    fashion.append(tolerance.build_sweep("fashion-mnist", ["median", "trimmed", "krum"],
                                         tolerance.ATTACKS, [0.3], 10, [0]))
    made = {r.run_id for sweep in fashion for r in sweep.runs}
    committed = {p.name for p in (ROOT / "experiments/runs/faults-fashion").glob("r-*")}
    assert committed == made


def test_the_report_reads_loose_runs_and_puts_wire_factors_beside_payload_factors(tmp_path):
    """``fedcomp report results/``: runs outside a sweep, each its own method; a deployed
    run's bytes on the wire appear in a table of their own, a simulated run's do not."""
    from fedcomp.ops.results import RoundRecord, RunRecorder

    for name, wire in (("deployed", True), ("simulated", False)):
        recorder = RunRecorder(tmp_path / name, {"codec": "sign"}, model_bytes=40_000,
                               num_rounds=2, verbose=False)
        for round_ in (1, 2):
            recorder.record(RoundRecord(
                round_, accuracy=0.5 + 0.1 * round_, uplink_bytes=1_000, downlink_bytes=4_000,
                clients_ok=2, clients_sampled=2, **(dict(
                    uplink_density=0.02, uplink_value_bits=1.5 + round_,
                    uplink_tensor_density=f"fc1.weight=0.01;conv2={0.1 * round_:g};fc2=0",
                    uplink_tensor_sent=f"fc1.weight=1;conv2={0.5 * round_:g}",
                    downlink_density=0.1, downlink_value_bits=4.0,
                    downlink_tensor_density=f"fc1.weight=0.05;conv2={0.2 * round_:g}")
                    if not wire else dict(
                    wire_nodes=2, wire_up_bytes=30_000, wire_down_bytes=14_000,
                    protocol_up_bytes=29_000, protocol_down_bytes=10_000))))
        recorder.finish()
    (tmp_path / "not-a-run").mkdir()
    assert [r.method for r in load_runs(tmp_path)] == ["deployed", "simulated"]
    budgeted = load_runs(tmp_path / "simulated")[0].rounds[0]  # a byte budget's text column
    assert budgeted["uplink_tensor_density"] == "fc1.weight=0.01;conv2=0.1;fc2=0"
    assert budgeted["uplink_density"] == 0.02
    assert [r.method for r in load_runs(tmp_path / "deployed")] == ["deployed"]
    table, paths = write_report(tmp_path, target=0.65)
    # Only the budgeted run has choices to plot, round by round.
    assert (tmp_path / "budget_choices.png") in paths
    simulated = build_report(load_runs(tmp_path), 0.65)[1][1]
    assert simulated.method == "simulated"
    # fc2 is never sent: drawn as no line (a log axis has no zero) but named.
    assert budget_choice_series(simulated, "uplink") == {
        "fc1.weight": ([1, 2], [0.01, 0.01]), "conv2": ([1, 2], [0.1, 0.2]),
        "fc2": ([1, 2], [0.0, 0.0])}
    assert budget_choice_series(simulated, "downlink")["conv2"] == ([1, 2], [0.2, 0.4])
    assert budget_choice_series(build_report(load_runs(tmp_path), 0.65)[1][0], "uplink") == {}
    wire_rows = [line for line in table.splitlines()
                 if line.startswith("| deployed | 4 |")]
    # 15 kB up and 7 kB down per node and round; the payloads: 80x up, 32x in all.
    assert [c.strip() for c in wire_rows[0].split("|")[1:-1]] == [
        "deployed", "4", "15.0", "14.5", "7.0", "5.0", "80.0", f"{40 / 15:.1f}", "32.0",
        f"{80 / 22:.1f}"]
    assert not any(line.startswith("| simulated | 4 |") for line in table.splitlines())
    # What the budget chose, as means over the rounds: only the budgeted run has a row.
    chose = table[table.index("**simulated**\n\n| tensor | uplink | downlink |"):].splitlines()
    chose = chose[2:]
    assert "**deployed**" not in table  # no budget, no table
    # Uplink: conv2 carried by half the payloads in round 1 and all in round 2.
    assert chose[2:6] == ["| `fc1.weight` | 1% in 100% | 5% |",
                          "| `conv2` | 15% in 75% | 30% |",
                          "| `fc2` | 0% | - |",
                          "| bits a kept value | 3.00 | 4.00 |"]
    with pytest.raises(ValueError, match="no sweep"):
        load_runs(tmp_path / "not-a-run")


def test_the_report_shows_how_far_error_feedback_lags_by_quarter(tmp_path):
    """``feedback_ratio`` in the report: a table of each error-feedback run's mean per
    quarter of its rounds, and a plot; a run without the column (no error feedback,
    or recorded before it existed) has no row."""
    nan = float("nan")
    growing = [1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]
    # (ratio, residual) by round: the lagging run's residual grows with the ratio; the
    # converging run's ratio grows as much while its residual stays put (its updates
    # shrink); the settled run's both stay.
    runs = {"lagging": (growing, [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]),
            "converging": (growing, [0.0] + [4.0] * 7),
            "settled": ([1.0] + [2.0] * 7, [0.0] + [2.0] * 7),
            "no-feedback": ([nan] * 8, [nan] * 8)}
    for name, (ratios, residuals) in runs.items():
        recorder = RunRecorder(tmp_path / name, {"codec": "sign"}, model_bytes=40_000,
                               num_rounds=8, verbose=False)
        for round_, (ratio, residual) in enumerate(zip(ratios, residuals, strict=True), start=1):
            recorder.record(RoundRecord(round_, accuracy=0.5, uplink_bytes=1_000,
                                        downlink_bytes=4_000, clients_ok=2,
                                        clients_sampled=2, feedback_ratio=ratio,
                                        feedback_residual=residual))
        recorder.finish()
    table, paths = write_report(tmp_path, target=0.4)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in table[table.index("Error feedback"):].splitlines()
            if line.startswith("| ") and not line.startswith("| method")}
    # Rounds 1-2, 3-4, 5-6, 7-8; one seed each; the residual's growth is the mean of
    # rounds 7-8 over that of rounds 3-4.
    assert rows == {"lagging": ["1", "1.50", "5.00", "9.00", "13.00", "2.60"],
                    "converging": ["1", "1.50", "5.00", "9.00", "13.00", "1.00"],
                    "settled": ["1", "1.50", "2.00", "2.00", "2.00", "1.00"]}
    assert (tmp_path / "feedback_ratio.png") in paths
    # With no plain FedAvg run, the whole-run factors are against the fp32 model in
    # the same rounds: 2 x 40 kB up over 1 kB sent, and 80 + 80 kB over 5 kB in all.
    assert "against the fp32 model sent both ways in the same rounds" in table
    whole = [line for line in table.splitlines() if line.startswith("| settled | 1 | 8 |")]
    assert [c.strip() for c in whole[0].split("|")[-3:-1]] == ["80", "32.0"]
    methods = build_report(load_runs(tmp_path), 0.4)[1]
    assert feedback_series(next(m for m in methods if m.method == "no-feedback")) == ([], [])
