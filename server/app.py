"""fedcomp ServerApp: runs ``CompressedFedAvg`` with centralized evaluation.

Thin by design: configuration parsing, data, the strategy and the results recorder
all come from ``fedcomp`` and ``strategies``; this file wires them to Flower.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedcomp.config import RunConfig
from fedcomp.data import load_dataset
from fedcomp.models import build_model
from fedcomp.results import RunRecorder
from fedcomp.training import evaluate, state_arrays
from strategies.compressed import CompressedFedAvg

log = logging.getLogger(__name__)

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_server(grid, RunConfig.from_mapping(context.run_config))


def run_server(grid: Grid, cfg: RunConfig, *, verbose: bool = True
               ) -> tuple[dict[str, Any], CompressedFedAvg]:
    """Run the whole federated job; return the summary and the strategy."""
    torch.set_num_threads(1)
    model = build_model(cfg.dataset, seed=cfg.seed)
    initial = state_arrays(model)
    _, test = load_dataset(cfg.dataset, cfg.data_dir, cfg.test_fraction, cfg.seed)
    strategy = CompressedFedAvg(cfg, initial)
    recorder = RunRecorder(
        Path(cfg.results_dir) / cfg.resolved_run_name, cfg.describe(),
        model_bytes=4 * sum(v.size for v in initial.values()),
        num_rounds=cfg.num_server_rounds, verbose=verbose,
    )
    if verbose:
        print(f"fedcomp: {cfg.dataset}, {cfg.num_server_rounds} rounds, uplink "
              f"{cfg.codec!r}, downlink {cfg.downlink_codec!r}, feedback {cfg.feedback}; "
              f"results in {recorder.out_dir}", flush=True)

    def evaluate_fn(server_round: int, _arrays: Any) -> MetricRecord:
        # Evaluate the shared model: exactly what clients hold.
        model.load_state_dict({k: torch.from_numpy(v.copy())
                               for k, v in strategy.broadcaster.model.items()})
        accuracy, loss = evaluate(model, test.x, test.y)
        if server_round == 0:
            recorder.initial_accuracy = accuracy
        elif server_round in strategy.stats:
            stats = strategy.stats[server_round]
            stats.record.accuracy, stats.record.loss = accuracy, loss
            recorder.record(stats.record, stats.rejected_by_reason)
        return MetricRecord({"accuracy": accuracy, "loss": loss if math.isfinite(loss) else -1})

    strategy.start(grid=grid, initial_arrays=strategy.current_arrays(),
                   num_rounds=cfg.num_server_rounds, timeout=cfg.round_timeout,
                   evaluate_fn=evaluate_fn)
    recorder.extra = {
        "replica_checks": sum(s.replica_checks for s in strategy.stats.values()),
        "replica_mismatches": sum(s.replica_mismatches for s in strategy.stats.values()),
    }
    return recorder.finish(), strategy
