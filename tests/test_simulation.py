"""End to end: real Flower simulations (in process) of the ClientApp and our strategy.

Each simulation takes about 10-20 s on 2 cores, so they are marked slow and few, and
each checks several things that could each fail.
"""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

import clients.app as client_module
from fedcomp.config import RunConfig
from fedcomp.flower import payload_from_record
from fedcomp.ops.results import ROUND_COLUMNS
from server.simulation import simulate as run_simulation_in_process

pytestmark = pytest.mark.slow

def simulate(cfg: RunConfig, num_supernodes: int, corrupt_partition: int | None = None):
    """Run a simulation, optionally with one client flipping a bit of its payload."""
    client = ClientApp()
    client.query()(client_module.query)

    @client.train()
    def _train(msg: Message, context: Context) -> Message:
        reply = client_module.train(msg, context)
        if int(context.node_config["partition-id"]) == corrupt_partition:
            payload = bytearray(payload_from_record(reply.content["update"]))
            payload[len(payload) // 2] ^= 0x01  # one flipped bit on the way
            reply.content["update"]["payload"] = bytes(payload)
        return reply

    return run_simulation_in_process(cfg, num_supernodes=num_supernodes, client_app=client)


def _rows(summary, results_dir) -> list[dict]:
    with open(results_dir / summary["run_name"] / "rounds.csv") as handle:
        return list(csv.DictReader(handle))


def test_compressed_run_counts_bytes_uses_feedback_rejects_corruption_and_syncs_replicas(
        tmp_path):
    cfg = RunConfig(num_server_rounds=3, clients_per_round=3, local_steps=5, local_epochs=0,
                    codec="topk:ratio=0.01|quant:bits=4",
                    downlink_codec="topk:ratio=0.05|quant:bits=8", downlink_mode="shared",
                    results_dir=str(tmp_path), run_name="compressed", seed=3)
    summary, strategy = simulate(cfg, num_supernodes=4, corrupt_partition=0)

    # The run completed every round and wrote its results.
    assert summary["rounds_completed"] == 3
    rows = _rows(summary, tmp_path)
    assert list(rows[0]) == ROUND_COLUMNS and len(rows) == 3
    assert json.loads((tmp_path / "compressed" / "summary.json").read_text())[
        "config"]["codec-config"]["stages"][0]["id"] == "topk"

    corrupted_rounds = 0
    for rnd, stats in strategy.stats.items():
        row = rows[rnd - 1]
        # Bytes counted == bytes the clients put into their messages.
        assert int(row["uplink_bytes"]) == sum(
            int(m["payload-bytes"]) for m in stats.client_metrics.values())
        assert int(row["downlink_bytes"]) == sum(
            int(m["downlink-bytes"]) for m in stats.client_metrics.values())
        # The corrupted client is rejected by its checksum; the round goes on.
        sampled_corrupt = stats.rejected_by_reason.get("checksum", 0)
        corrupted_rounds += sampled_corrupt
        assert int(row["clients_ok"]) == len(stats.client_metrics) - sampled_corrupt
        assert int(row["rejected"]) == sampled_corrupt
    assert corrupted_rounds >= 1
    assert summary["rejected_by_reason"] == {"checksum": corrupted_rounds}

    # Error feedback: a client's residual is empty on its first round and carried into
    # its next one.
    seen: dict[int, list[float]] = {}
    for rnd in sorted(strategy.stats):
        for node, metrics in strategy.stats[rnd].client_metrics.items():
            seen.setdefault(node, []).append(metrics["residual-norm-in"])
    assert all(norms[0] == 0.0 for norms in seen.values())
    assert any(len(norms) > 1 and norms[1] > 0 for norms in seen.values())

    # Every replying client held exactly the server's shared model.
    assert summary["replica_checks"] >= 8 and summary["replica_mismatches"] == 0
    # Partial participation: someone caught up on missed compressed updates.
    assert rows[-1]["cum_downlink_bytes"] > rows[0]["downlink_bytes"]


def test_one_seed_draws_the_same_partitions_and_top1_4bit_sends_50x_fewer_bytes(tmp_path):
    """Flower's node ids are random per run; the clients drawn must not be. The two
    runs differ only in their codecs, which must not change who is drawn."""
    base = RunConfig(num_server_rounds=3, clients_per_round=2, local_steps=2,
                     local_epochs=0, results_dir=str(tmp_path), seed=5)
    runs, drawn = {}, []
    for name, cfg in (("default", base),
                      ("fp32", base.replace(codec="none", feedback="none",
                                            downlink_codec="none"))):
        runs[name], strategy = simulate(cfg.replace(run_name=name), num_supernodes=6)
        drawn.append([sorted(int(m["partition-id"]) for m in strategy.stats[r]
                             .client_metrics.values()) for r in sorted(strategy.stats)])
        assert sorted(strategy.partition_of.values()) == list(range(6))
    assert drawn[0] == drawn[1] and len(drawn[0]) == 3
    assert all(len(partitions) == 2 for partitions in drawn[0])

    compressed, plain = runs["default"], runs["fp32"]
    assert compressed["rounds_completed"] == plain["rounds_completed"] == 3
    assert plain["uplink_bytes"] >= 50 * compressed["uplink_bytes"]
    # fp32 "none" sends the model and a little framing: within 1% of 4 bytes/parameter.
    assert plain["uplink_bytes"] == pytest.approx(plain["fp32_uplink_bytes"], rel=0.01)
    # The default compresses the downlink too: far fewer bytes down than the fp32 run.
    assert plain["downlink_bytes"] >= 5 * compressed["downlink_bytes"]
    assert compressed["total_compression"] > 20 * plain["total_compression"]
    assert np.isfinite(compressed["final_accuracy"])


def test_saved_models_are_the_evaluated_ones_and_the_average_replays_from_them(tmp_path):
    """save-model-every writes what the run evaluated; the average is their EMA."""
    import torch

    from fedcomp.federated.averaging import ModelAverage
    from fedcomp.federated.checkpoint import load_model
    from fedcomp.tasks.data import load_dataset
    from fedcomp.tasks.models import build_model
    from fedcomp.tasks.training import evaluate

    cfg = RunConfig(num_server_rounds=3, clients_per_round=2, local_steps=3, local_epochs=0,
                    server_average=0.5, save_model_every=2, results_dir=str(tmp_path),
                    run_name="saved", seed=2)
    assert cfg.replace(save_model_every=0).digest() == cfg.digest()  # same run id
    summary, _ = simulate(cfg, num_supernodes=3)
    every_two = tmp_path / "saved" / "models"
    # Round 0, every 2nd round and the last, each with its average.
    assert sorted(p.name for p in every_two.iterdir()) == [
        f"round-{r:04d}{kind}.npz" for r in (0, 2, 3) for kind in (".average", "")]

    def accuracy(arrays):
        model = build_model(cfg.dataset, seed=cfg.seed)
        model.load_state_dict({k: torch.from_numpy(v) for k, v in arrays.items()})
        _, test = load_dataset(cfg.dataset, cfg.data_dir, cfg.test_fraction, cfg.seed)
        with torch.inference_mode():
            return evaluate(model, test.x, test.y)[0]

    # What was saved is what was evaluated.
    assert accuracy(load_model(every_two / "round-0003.npz")) == summary["final_raw_accuracy"]
    assert accuracy(load_model(every_two / "round-0003.average.npz")) == \
        summary["final_accuracy"]

    # With every round saved, the server's average is the EMA replayed from the saved
    # models, bit for bit (same seed: the same run, trained deterministically).
    cfg = cfg.replace(save_model_every=1, run_name="every")
    simulate(cfg, num_supernodes=3)
    every = tmp_path / "every" / "models"
    replay = ModelAverage(0.5, load_model(every / "round-0000.npz"))
    for rnd in (1, 2, 3):
        replay.update(load_model(every / f"round-{rnd:04d}.npz"))
        saved = load_model(every / f"round-{rnd:04d}.average.npz")
        assert all(np.array_equal(saved[k], replay.value[k]) for k in saved)
    # ... and the two runs of one config trained the same models.
    np.testing.assert_array_equal(load_model(every / "round-0003.npz")["fc1.weight"],
                                  load_model(every_two / "round-0003.npz")["fc1.weight"])
