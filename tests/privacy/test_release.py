"""Nothing measured on a client's data leaves a DP run un-noised."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from fedcomp.config import RunConfig
from fedcomp.federated.client_round import ClientState, dp_sgd_plan_reply, run_client_round
from fedcomp.federated.downlink import Broadcaster
from fedcomp.ops.results import RoundRecord, RunRecorder
from fedcomp.privacy.release import (
    DP_CLIENT_METRICS,
    RELEASED_ROUND_COLUMNS,
    RELEASED_SUMMARY_KEYS,
)
from fedcomp.tasks.data import ArrayDataset, load_partition
from fedcomp.tasks.models import build_model
from fedcomp.tasks.training import state_arrays


@pytest.mark.parametrize("dp", ["client", "sample"])
def test_a_dp_client_reply_carries_only_its_bookkeeping_and_the_mechanisms_inputs(dp):
    cfg = RunConfig(local_steps=2, local_epochs=0, dp=dp, dp_adaptive_clip=dp == "client")
    server = Broadcaster(state_arrays(build_model("digits", seed=0)), cfg.downlink_policy)
    data = load_partition("digits", 0, 5, scheme="iid")
    result = run_client_round(cfg, ClientState.fresh(cfg), server.message_for(None), data,
                              server_round=1, client_seed=0)
    assert set(result.metrics) <= DP_CLIENT_METRICS
    for leaked in ("num-examples", "train-loss", "delta-norm", "payload-bytes", "train-s",
                   "residual-norm-in", "encode-s"):
        assert leaked not in result.metrics
    wanted = {"dp-unclipped"} if dp == "client" else {"dp-sample-rate", "dp-steps"}
    assert wanted <= set(result.metrics)
    plain = run_client_round(cfg.replace(dp="none", dp_adaptive_clip=False),
                             ClientState.fresh(cfg), server.message_for(None), data,
                             server_round=1, client_seed=0)
    assert "train-loss" in plain.metrics and "num-examples" in plain.metrics


def test_a_dp_run_releases_only_the_listed_columns_and_writes_no_client_rows(tmp_path):
    recorder = RunRecorder(tmp_path, {"dp": "client"}, model_bytes=400, num_rounds=2,
                           verbose=False, private=True)
    for round_ in (1, 2):
        recorder.record(RoundRecord(round_, accuracy=0.5, uplink_bytes=123, clients_ok=7,
                                    epsilon=0.1 * round_),
                        clients={5: {"partition-id": 1.0, "payload-bytes": 123.0}})
    recorder.extra = {"epsilon": 0.2, "dp_delta": 1e-5}
    recorder.finish()
    assert not (tmp_path / "clients.csv").exists()
    with open(tmp_path / "release" / "rounds.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == list(RELEASED_ROUND_COLUMNS)
    assert [float(r["epsilon"]) for r in rows] == [0.1, 0.2]
    released = json.loads((tmp_path / "release" / "summary.json").read_text())
    assert set(released) <= set(RELEASED_SUMMARY_KEYS)
    assert "uplink_bytes" not in released and released["epsilon"] == 0.2
    # The operator's own record keeps the exact figures.
    assert json.loads((tmp_path / "summary.json").read_text())["uplink_bytes"] == 246


def test_a_client_refuses_a_delta_its_dataset_size_makes_meaningless():
    data = load_partition("digits", 0, 5, scheme="iid")
    ok = dp_sgd_plan_reply(RunConfig(dp="sample", batch_size=32), data)
    assert ok["examples"] == len(data) and 0 < ok["rate"] <= 1 and ok["steps"] > 0
    refused = dp_sgd_plan_reply(RunConfig(dp="sample", dp_delta=1 / len(data)), data)
    assert "'dp-delta'" in refused["error"]


def test_the_reply_metrics_of_a_dp_round_hold_no_float_that_depends_on_the_data_alone():
    """Two clients with different data send the same bookkeeping (sample level: the
    same rate and steps when their sizes match)."""
    cfg = RunConfig(local_steps=2, local_epochs=0, dp="sample")
    server = Broadcaster(state_arrays(build_model("digits", seed=0)), cfg.downlink_policy)
    metrics = []
    for partition in (0, 1):
        full = load_partition("digits", partition, 4, scheme="iid")
        data = ArrayDataset(full.x[:100], full.y[:100])
        metrics.append(run_client_round(cfg, ClientState.fresh(cfg), server.message_for(None),
                                        data, server_round=1, client_seed=0).metrics)
    assert metrics[0] == metrics[1]
    assert np.isfinite(list(metrics[0].values())).all()
