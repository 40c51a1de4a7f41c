#!/usr/bin/env python
"""Share of a round's wall time spent in compression, against local training.

Replays the default run (``pyproject.toml``'s config, or overrides given as
``key=value``) in one process and one thread, client after client, through the very
functions the ClientApp and the strategy call (``run_client_round``,
``aggregate_deltas``, ``Broadcaster``). Run sequentially, every part of a round is
timed exactly and the parts add up to the round's wall time, which a parallel
simulation would blur. Flower's messaging is left out: it is neither compression
nor training.

    python experiments/bench_round_overhead.py [--run-config "key=value key='text'"]

Target: encode + decode <= 5% of the round's wall time.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import sys
import time
import tomllib
from pathlib import Path

import torch
from flwr.common.config import parse_config_args

from fedcomp.config import RunConfig
from fedcomp.federated.aggregation import ClientReply, aggregate_deltas
from fedcomp.federated.client_round import ClientState, run_client_round
from fedcomp.federated.downlink import Broadcaster
from fedcomp.federated.server_opt import ServerOptimizer
from fedcomp.tasks.data import load_dataset, load_partition
from fedcomp.tasks.models import build_model
from fedcomp.tasks.training import evaluate, load_arrays, state_arrays

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--run-config", default="",
                        help="overrides with flwr run's syntax: \"key=value key='text'\"")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    defaults = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    overrides = parse_config_args([args.run_config]) if args.run_config else {}
    cfg = RunConfig.from_mapping({**defaults["config"], **overrides})
    model = build_model(cfg.task_name, seed=cfg.seed)
    server = Broadcaster(state_arrays(model), cfg.downlink_policy, seed=cfg.seed)
    optimizer = ServerOptimizer(cfg.server_optimizer, lr=cfg.server_lr,
                                momentum=cfg.server_momentum)
    expected = cfg.uplink_policy.expected(server.shapes)
    _, test = load_dataset(cfg.task_name, cfg.data_dir, cfg.test_fraction, cfg.seed)
    data = [load_partition(cfg.task_name, i, args.clients, scheme=cfg.partitioning,
                           alpha=cfg.dirichlet_alpha, classes_per_client=cfg.classes_per_client,
                           seed=cfg.seed, data_dir=cfg.data_dir) for i in range(args.clients)]
    states = [ClientState.fresh(cfg) for _ in range(args.clients)]
    known: dict[int, int] = {}
    totals = {"train": 0.0, "uplink encode": 0.0, "uplink decode": 0.0,
              "downlink encode": 0.0, "downlink decode": 0.0, "round wall": 0.0}
    print(f"replaying {cfg.num_server_rounds} rounds x {args.clients} clients: "
          f"{cfg.task_name}, codec {cfg.codec!r}, downlink {cfg.downlink_codec!r}", flush=True)
    accuracy = float("nan")
    for server_round in range(1, cfg.num_server_rounds + 1):
        round_start = time.perf_counter()
        replies = []
        for i in range(args.clients):
            result = run_client_round(cfg, states[i], server.message_for(known.get(i)), data[i],
                                      server_round=server_round, client_seed=i)
            known[i] = server.round
            totals["train"] += result.metrics["train-s"]
            totals["uplink encode"] += result.metrics["encode-s"]
            totals["downlink decode"] += result.metrics["downlink-decode-s"]
            replies.append(ClientReply(i, result.payload, result.metrics["num-examples"]))
        aggregated = aggregate_deltas(replies, expected, expected_meta={"round": server_round})
        totals["uplink decode"] += aggregated.decode_s
        start = time.perf_counter()
        server.publish(optimizer.step(server.model, aggregated.mean_delta))
        totals["downlink encode"] += time.perf_counter() - start
        totals["round wall"] += time.perf_counter() - round_start
    load_arrays(model, server.model)
    accuracy, _ = evaluate(model, test.x, test.y)

    wall = totals["round wall"]
    codec_s = sum(v for k, v in totals.items() if "code" in k)
    print(f"\n{'part':18s} {'seconds':>9s} {'share of round wall':>20s}")
    for part, seconds in totals.items():
        print(f"{part:18s} {seconds:9.3f} {100 * seconds / wall:19.2f}%")
    print(f"{'encode + decode':18s} {codec_s:9.3f} {100 * codec_s / wall:19.2f}%")
    share = codec_s / wall
    print(f"\n{'PASS' if share <= 0.05 else 'FAIL'}  encode + decode = {100 * share:.2f}% of "
          f"round wall time (target <= 5%); training {100 * totals['train'] / wall:.1f}%; "
          f"final accuracy {accuracy:.4f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"config": cfg.to_mapping(), "seconds": totals,
                                         "codec_share": share, "accuracy": accuracy}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
