"""fedcomp ServerApp: runs ``CompressedFedAvg`` with centralized evaluation.

Thin by design: configuration parsing, data, the strategy and the results recorder
all come from ``fedcomp`` and ``strategies``; this file wires them to Flower.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedcomp.config import RunConfig
from fedcomp.federated.checkpoint import load_checkpoint, save_checkpoint, save_model
from fedcomp.flower.grid import PromptGrid
from fedcomp.ops.results import RunRecorder
from fedcomp.tasks import Task, check_task
from fedcomp.tasks.training import load_arrays, state_arrays
from strategies.compressed import CompressedFedAvg

log = logging.getLogger(__name__)

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_server(grid, RunConfig.from_mapping(context.run_config,
                                            explicit=keys_set_by_user(grid)))


def keys_set_by_user(grid: Grid) -> frozenset[str]:
    """The run-config keys ``flwr run --run-config`` set (the run's override config).

    Flower hands the ServerApp every key, defaults included; these are the ones the
    user wrote, so that one set to its default still wins over a preset's setting.
    Empty where the grid has no run (a test's stand-in): then a key at its default
    is taken as left alone.
    """
    try:
        return frozenset(grid.run.override_config or ())
    except (AttributeError, TypeError):  # Flower's grids raise TypeError before set_run
        return frozenset()


def run_server(grid: Grid, cfg: RunConfig, *, verbose: bool = True,
               on_round_end: Callable[[int], None] | None = None,
               ) -> tuple[dict[str, Any], CompressedFedAvg]:
    """Run the whole federated job; return the summary and the strategy.

    After every round the results files are updated and, with ``checkpoint = true``,
    ``checkpoint.npz`` is written atomically beside them (every ``checkpoint-every``
    rounds and after the last: a per-client downlink's checkpoint holds every client's
    replica, 166 MB in the headline setting). With ``resume = true`` a
    run continues from that checkpoint (same run name, same settings).
    With ``save-model-every = N`` the server's model after round 0, every N-th round
    and the last goes to ``models/round-NNNN.npz`` (with ``server-average``, the
    average to ``round-NNNN.average.npz``): what a user loads in a notebook, and what
    lets averaging schemes be compared offline on one run's models.
    ``on_round_end(round)`` is called after the checkpoint (tests use it to play a
    server that dies).
    """
    torch.set_num_threads(1)
    # A task that lacks something stops the run here, before round 1, naming it.
    task = check_task(cfg.task_name, cfg.data_dir, cfg.test_fraction, cfg.seed)
    model = task.build_model(cfg.seed)
    initial = state_arrays(model)
    _, test = task.load_data(cfg.data_dir, cfg.test_fraction, cfg.seed)
    strategy = CompressedFedAvg(cfg, initial)
    out_dir = Path(cfg.results_dir) / cfg.resolved_run_name
    recorder = RunRecorder(out_dir, cfg.describe(),
                           model_bytes=4 * sum(v.size for v in initial.values()),
                           num_rounds=cfg.num_server_rounds, verbose=verbose,
                           private=cfg.dp != "none")
    checkpoint_path = out_dir / "checkpoint.npz"
    done = _resume(cfg, checkpoint_path, strategy, recorder) if cfg.resume else 0
    if verbose:
        print(f"fedcomp: {cfg.task_name}, {cfg.num_server_rounds} rounds, uplink "
              f"{cfg.codec!r}, downlink {cfg.downlink_codec!r}, feedback {cfg.feedback}; "
              f"results in {recorder.out_dir}"
              + (f"; resuming after round {done}" if done else ""), flush=True)
        shapes = {name: value.shape for name, value in initial.items()}
        for notice in (*cfg.notices, *cfg.budget_notices(shapes)):
            print(f"fedcomp: note: {notice}", flush=True)

    def evaluate_fn(flower_round: int, _arrays: Any) -> MetricRecord:
        # Evaluate the server's model: what every client holds (shared downlink), or
        # holds up to what its own downlink has not sent yet (per-client downlink);
        # with server-average, its average over rounds (and the model itself as
        # raw_accuracy).
        server_round = flower_round + done
        accuracy, loss, raw_accuracy = math.nan, math.nan, math.nan
        if (server_round % cfg.eval_every == 0 or server_round >= cfg.num_server_rounds
                or (flower_round == 0 and not done)):
            # The clients are idle while the server evaluates: use every core.
            torch.set_num_threads(os.cpu_count() or 1)
            accuracy, loss = _evaluate(task, model, strategy.evaluated_model(), test)
            if strategy.average is not None:
                raw_accuracy, _ = _evaluate(task, model, strategy.broadcaster.model, test)
            torch.set_num_threads(1)
        if flower_round == 0:
            if not done:
                recorder.initial_accuracy = accuracy
                _save_models(cfg, recorder.out_dir, 0, strategy)
        elif server_round in strategy.stats:
            stats = strategy.stats[server_round]
            stats.record.accuracy, stats.record.loss = accuracy, loss
            stats.record.raw_accuracy = raw_accuracy
            recorder.record(stats.record, stats.rejected_by_reason, stats.client_metrics)
            _save_models(cfg, recorder.out_dir, server_round, strategy)
            if cfg.checkpoint and _due(server_round, cfg.checkpoint_every, cfg):
                arrays, meta = strategy.state_dict()
                save_checkpoint(checkpoint_path, arrays, {
                    "round": server_round, "config_digest": cfg.digest(),
                    "strategy": meta, "recorder": recorder.state()})
            if on_round_end is not None:
                on_round_end(server_round)
        return MetricRecord({"accuracy": accuracy if math.isfinite(accuracy) else -1.0,
                             "loss": loss if math.isfinite(loss) else -1.0})

    if cfg.num_server_rounds > done:
        strategy.start(grid=PromptGrid(grid), initial_arrays=strategy.current_arrays(),
                       num_rounds=cfg.num_server_rounds - done, timeout=cfg.round_timeout,
                       evaluate_fn=evaluate_fn)
    recorder.extra = {
        "replica_checks": sum(s.replica_checks for s in strategy.stats.values()),
        "replica_mismatches": sum(s.replica_mismatches for s in strategy.stats.values()),
        "skipped_rounds": {str(r): s.skipped for r, s in sorted(strategy.stats.items())
                           if s.skipped},
        "resumed_after_round": done,
        **strategy.privacy.summary(),
        "stopped_early": strategy.stopped,
        "encoder": cfg.encoder_fingerprint({k: v.shape for k, v in initial.items()}),
    }
    return recorder.finish(), strategy


def _due(server_round: int, every: int, cfg: RunConfig) -> bool:
    """Whether a write every ``every`` rounds falls on ``server_round`` (the last always)."""
    return server_round % every == 0 or server_round >= cfg.num_server_rounds


def _save_models(cfg: RunConfig, out_dir: Path, server_round: int,
                 strategy: CompressedFedAvg) -> None:
    """Write the server's model (and its average) after round 0 and each due round."""
    if not cfg.save_model_every or (server_round
                                    and not _due(server_round, cfg.save_model_every, cfg)):
        return
    stem = Path(out_dir) / "models" / f"round-{server_round:04d}"
    save_model(stem.with_suffix(".npz"), strategy.broadcaster.model)
    if strategy.average is not None:
        save_model(stem.with_suffix(".average.npz"), strategy.average.value)


def _evaluate(task: Task, model: torch.nn.Module, arrays: dict[str, Any], test: Any
              ) -> tuple[float, float]:
    """Test accuracy and loss of ``arrays`` (loaded into ``model``)."""
    load_arrays(model, arrays)
    with torch.inference_mode():
        return task.evaluate(model, test.x, test.y)


def _resume(cfg: RunConfig, path: Path, strategy: CompressedFedAvg,
            recorder: RunRecorder) -> int:
    """Load the checkpoint into the strategy and recorder; return the rounds done."""
    if not path.exists():
        log.warning("resume = true but %s does not exist: starting from round 1", path)
        return 0
    arrays, meta = load_checkpoint(path)
    if meta["config_digest"] != cfg.digest():
        raise ValueError(f"{path} was written by a run with other settings; use another "
                         "run-name or the same settings to resume")
    strategy.load_state_dict(arrays, meta["strategy"])
    recorder.restore(meta["recorder"])
    strategy.round_offset = int(meta["round"])
    return int(meta["round"])
