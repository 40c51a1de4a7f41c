"""End to end under faults: injected dropouts and corruption; a killed, resumed server."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from fedcomp.config import RunConfig
from fedcomp.federated.downlink import model_digest
from fedcomp.tasks.models import build_model
from fedcomp.tasks.training import state_arrays
from server.simulation import simulate

pytestmark = pytest.mark.slow


def test_dropouts_and_corrupt_payloads_are_counted_exactly_as_injected(tmp_path):
    cfg = RunConfig(num_server_rounds=3, local_steps=2, local_epochs=0, fault_dropout=0.3,
                    fault_corrupt=0.1, fault_seed=11, results_dir=str(tmp_path),
                    run_name="faults", seed=2)
    summary, _ = simulate(cfg, num_supernodes=6)
    assert summary["rounds_completed"] == 3
    # The summary records which encoder made its bytes (what a sweep compares).
    assert summary["encoder"] == cfg.encoder_fingerprint(
        {k: v.shape for k, v in state_arrays(build_model(cfg.dataset, seed=0)).items()})
    with open(tmp_path / "faults" / "rounds.csv") as handle:
        rows = list(csv.DictReader(handle))
    plan = cfg.fault_plan
    injected = {"dropout": 0, "corrupt": 0}
    for row in rows:
        draws = [plan.draw(int(row["round"]), p) for p in range(6)]
        assert int(row["clients_failed"]) == draws.count("dropout")
        assert int(row["rejected"]) == draws.count("corrupt")
        assert int(row["clients_ok"]) == 6 - draws.count("dropout") - draws.count("corrupt")
        injected["dropout"] += draws.count("dropout")
        injected["corrupt"] += draws.count("corrupt")
    assert injected["dropout"] >= 2 and injected["corrupt"] >= 1  # the test tests something
    assert summary["rejected_updates"] == injected["corrupt"]
    assert set(summary["rejected_by_reason"]) <= {"checksum", "truncated", "size"}
    # Error feedback: a client whose update was rejected gives it back to its residual
    # in its next round, and only then (a dropped-out client sent nothing to give back).
    with open(tmp_path / "faults" / "clients.csv") as handle:
        replies = list(csv.DictReader(handle))
    checked = 0
    for reply in replies:
        rnd, partition = int(reply["round"]), int(float(reply["partition-id"]))
        if rnd == 1:
            continue
        after_rejection = plan.draw(rnd - 1, partition) == "corrupt"
        assert (float(reply["given-back-norm"]) > 0) == after_rejection, reply
        checked += after_rejection
    assert checked >= 1


class ServerKilled(Exception):
    pass


def _kill_after(cfg: RunConfig, server_round: int, num_supernodes: int) -> None:
    """Run ``cfg`` until its server dies at the end of ``server_round``."""

    def die(finished_round: int) -> None:
        if finished_round == server_round:
            raise ServerKilled

    with pytest.raises(Exception) as info:
        simulate(cfg, num_supernodes=num_supernodes, on_round_end=die)
    assert "ServerKilled" in repr(info.value) or isinstance(info.value, ServerKilled)


def test_a_run_killed_after_round_2_and_resumed_ends_with_the_same_model(tmp_path):
    # The shared downlink: every client's replica is the server's model, so clients
    # that lost their memory with the killed simulation rebuild it exactly. (A per-client
    # replica lost that way is replaced by the full model, which changes the training
    # that follows: the next test.)
    base = RunConfig(num_server_rounds=4, local_steps=2, local_epochs=0, feedback="none",
                     codec="topk:ratio=0.05|quant:bits=4",
                     downlink_codec="topk:ratio=0.2|quant:bits=8", downlink_mode="shared",
                     results_dir=str(tmp_path), seed=5)
    _, uninterrupted = simulate(base.replace(run_name="whole"), num_supernodes=3)

    whole = np.concatenate([v.ravel() for v in uninterrupted.broadcaster.model.values()])
    assert np.isfinite(whole).all()

    # Checkpointed every 2 rounds and killed after round 3, so round 3 is replayed: it
    # resumes after round 2 and ends with the uninterrupted run's model, each round's
    # rows written once. (Resuming from the last round's checkpoint is the simpler case
    # of the same path; tests/test_checkpoint.py covers the files.)
    for name, every, killed_after in (("every-2", 2, 3),):
        interrupted = base.replace(run_name=name, checkpoint_every=every)
        assert interrupted.digest() == base.digest()  # same run id
        _kill_after(interrupted, killed_after, num_supernodes=3)
        summary, resumed = simulate(interrupted.replace(resume=True), num_supernodes=3)
        assert summary["resumed_after_round"] == 2 and summary["rounds_completed"] == 4
        assert model_digest(resumed.broadcaster.model) == model_digest(
            uninterrupted.broadcaster.model)
        with open(tmp_path / name / "rounds.csv") as handle:
            assert [int(r["round"]) for r in csv.DictReader(handle)] == [1, 2, 3, 4]
        with open(tmp_path / name / "clients.csv") as handle:
            replies = [(int(r["round"]), r["partition-id"]) for r in csv.DictReader(handle)]
        assert len(replies) == len(set(replies)) and {r for r, _ in replies} == {1, 2, 3, 4}


def test_per_client_downlink_survives_dropouts_and_a_resumed_server(tmp_path):
    """Catch-ups while replicas are known; the full model once they cannot be."""
    cfg = RunConfig(num_server_rounds=5, local_steps=2, local_epochs=0,
                    codec="topk:ratio=0.05|quant:bits=4",
                    downlink_codec="topk:ratio=0.1|quant:bits=4", downlink_mode="per-client",
                    fault_dropout=0.25, fault_seed=3, results_dir=str(tmp_path),
                    run_name="per-client", seed=4)

    _kill_after(cfg, 3, num_supernodes=4)
    summary, _ = simulate(cfg.replace(resume=True), num_supernodes=4)
    assert summary["resumed_after_round"] == 3 and summary["rounds_completed"] == 5
    # Every reply came from a client holding exactly the replica the server kept for it.
    assert summary["replica_mismatches"] == 0

    model_bytes = 4 * sum(v.size for v in state_arrays(build_model(cfg.dataset, seed=0)).values())
    with open(tmp_path / "per-client" / "clients.csv") as handle:
        replies = {(int(r["round"]), int(float(r["partition-id"]))): float(r["downlink-bytes"])
                   for r in csv.DictReader(handle)}
    plan = cfg.fault_plan
    expected_full = 0
    for (rnd, partition), sent in sorted(replies.items()):
        dropped_before = rnd > 1 and plan.draw(rnd - 1, partition) == "dropout"
        # A resumed simulation's clients start empty: each gets the full model once.
        full = dropped_before or rnd == 4
        expected_full += full
        assert (sent > model_bytes) == full, (rnd, partition, sent, model_bytes)
        assert full or sent < model_bytes / 4
    assert expected_full >= 5 and len(replies) >= 12  # dropouts and the resume both hit


def test_one_attacker_among_two_clients_cannot_break_the_model_under_the_defaults(tmp_path):
    """Two replies a round: no median of their own, yet the default bounds hold."""
    cfg = RunConfig(num_server_rounds=3, local_steps=2, local_epochs=0, attack_fraction=0.5,
                    results_dir=str(tmp_path), run_name="clean")
    clean, _ = simulate(cfg, num_supernodes=2)
    for attack in ("fltmax", "scale", "inflate"):
        summary, strategy = simulate(cfg.replace(attack=attack, run_name=attack),
                                     num_supernodes=2)
        assert summary["rounds_completed"] == 3
        assert all(np.isfinite(v).all() for v in strategy.broadcaster.model.values())
        # Bounded, not ignored: the model stays about as useful as the clean run's.
        assert summary["final_accuracy"] >= clean["final_accuracy"] - 0.15, attack
