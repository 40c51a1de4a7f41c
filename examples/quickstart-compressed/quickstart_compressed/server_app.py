"""The ServerApp: Flower's quickstart FedAvg, wrapped by fedcomp's CompressedUplink."""

from __future__ import annotations

import json
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedcomp.flower import CompressedUplink  # fedcomp
from quickstart_compressed.task import Net, load_centralized_test, test

app = ServerApp()

#: The app's settings when the run config leaves them out.
DEFAULTS = {"num-server-rounds": 5, "local-epochs": 2, "lr": 0.05,
            "codec": "topk:ratio=0.01|quant:bits=4", "results-dir": "results"}


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = {**DEFAULTS, **context.run_config}
    strategy = FedAvg(fraction_evaluate=0.0)
    strategy = CompressedUplink(strategy, codec=config["codec"])  # fedcomp
    model = Net()

    def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = test(model, load_centralized_test())
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    result = strategy.start(
        grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
        train_config=ConfigRecord({"lr": config["lr"], "local-epochs": config["local-epochs"]}),
        num_rounds=int(config["num-server-rounds"]), evaluate_fn=global_evaluate)
    model_bytes = 4 * sum(p.numel() for p in model.state_dict().values())
    rounds = {
        r: {"accuracy": result.evaluate_metrics_serverapp[r]["accuracy"],
            "uplink_bytes": strategy.history[r]["uplink-bytes"],
            "fp32_uplink_bytes": model_bytes * strategy.history[r]["decoded"]}
        for r in sorted(strategy.history)}
    out = Path(config["results-dir"]) / "quickstart-compressed.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"codec": config["codec"], "rounds": rounds}, indent=1))
    up = sum(r["uplink_bytes"] for r in rounds.values())
    fp32 = sum(r["fp32_uplink_bytes"] for r in rounds.values())
    print(f"final accuracy {rounds[max(rounds)]['accuracy']:.4f}; uplink {up / 1e3:.1f} kB "
          f"against {fp32 / 1e3:.1f} kB in fp32 ({fp32 / max(up, 1):.1f}x); {out}")
