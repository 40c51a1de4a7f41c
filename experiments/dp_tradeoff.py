"""Privacy against accuracy and bytes, at the sample level and the client level.

Two benchmarks, each a sweep of Flower simulations (complete runs are skipped on a
rerun):

* ``--part sample``: DP-SGD on every client (digits, 10 IID clients, 20 rounds of 2
  local epochs) at each target epsilon, with the uplink in fp32, dense 8-bit, a shared
  random subspace (Rand-K whose positions every client shares, 25% + 8-bit: no index
  bytes, noise on the subspace only) and Top-1% + 4-bit + error feedback; and the
  non-private fp32 run.
* ``--part client``: client-level DP-FedAvg at realistic scale (Fashion-MNIST, 1,000
  IID clients, each joins a round with probability 0.1, 100 rounds of 5 local epochs,
  adaptive clipping at the median update norm) at each target epsilon, with the
  uplink in fp32 and in a shared random subspace (10% + 8-bit); and non-private
  FedAvg (100 clients a round).

The noise multiplier of each target epsilon (delta 1e-5) is calibrated with the PLD
accountant, which is what the runs report; the table also gives the epsilon the RDP
accountant would report for the same noise, and the noise RDP would need. Bytes are
the mean payload of an accepted update, from the operator's ``rounds.csv`` (a DP run's
``release/`` folder does not publish them), against the fp32 model.

It writes ``OUT/sweep.toml`` (the sweep it runs), ``OUT/dp_tradeoff.csv`` and prints
the table::

    .venv/bin/python experiments/dp_tradeoff.py --part sample --out results/dp-sample
    .venv/bin/python experiments/dp_tradeoff.py --part client --out results/dp-client
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedcomp.config import RunConfig  # noqa: E402
from fedcomp.ops.cli import FLOWER_ENV, flower_runner  # noqa: E402
from fedcomp.ops.sweep import Sweep, run_sweep  # noqa: E402
from fedcomp.privacy.accounting import (  # noqa: E402
    dp_sgd_plan,
    epsilon_of,
    noise_multiplier_for,
)
from fedcomp.tasks.data import load_partition  # noqa: E402

TOPK = "topk:ratio=0.01|quant:bits=4"
DELTA = 1e-5

#: The settings every run of a part shares.
#: The downlink is the full model: the trade-off measured is the uplink's. The runs
#: without client-level DP keep the norm bound they were recorded with (3x the median),
#: and every run the JSON header it was recorded with.
BASES = {
    "sample": {"dataset": "digits", "partitioning": "iid", "num-server-rounds": 20,
               "local-epochs": 2, "lr": 0.05, "dp-clip-norm": 1.0, "dp-delta": DELTA,
               "downlink-codec": "none", "norm-bound": 3.0, "wire-header": "json"},
    "client": {"dataset": "fashion-mnist", "partitioning": "iid", "num-server-rounds": 100,
               "local-epochs": 5, "lr": 0.05, "clients-per-round": 100,
               "dp-clip-norm": 0.5, "dp-delta": DELTA, "downlink-codec": "none",
               "eval-every": 5, "checkpoint-every": 10, "wire-header": "json"},
}
CLIENTS = {"sample": 10, "client": 1000}
EPSILONS = {"sample": [1.0, 4.0, 8.0], "client": [4.0, 8.0]}


def sample_level_plan(base: dict, clients: int) -> tuple[float, int]:
    """The most exposed client's DP-SGD (rate, steps over the run): the smallest one."""
    cfg = RunConfig.from_mapping(base)
    smallest = min(len(load_partition(cfg.task_name, i, clients, scheme=cfg.partitioning,
                                      alpha=cfg.dirichlet_alpha, seed=cfg.seed).y)
                   for i in range(clients))
    rate, steps = dp_sgd_plan(smallest, batch_size=cfg.batch_size, epochs=cfg.local_epochs,
                              steps=cfg.local_steps)
    return rate, steps * cfg.num_server_rounds


def build_sweep(part: str, epsilons: list[float], clients: int) -> tuple[Sweep, dict]:
    """The part's sweep, and each method's accounting (rate, steps, sigma) by name."""
    base = dict(BASES[part])
    cfg = RunConfig.from_mapping(base)
    if part == "sample":
        rate, steps = sample_level_plan(base, clients)
        methods = [{"name": "non-private, fp32", "dp": "none", "codec": "none",
                    "feedback": "none"}]
        uplinks = [("fp32", {"codec": "none", "feedback": "none"}),
                   ("8-bit", {"codec": "quant:bits=8", "feedback": "none"}),
                   ("shared Rand-K 25% + 8-bit", {"codec": "quant:bits=8", "feedback": "none",
                                                  "shared-randk": 0.25}),
                   ("Top-1% + 4-bit + EF", {"codec": TOPK, "feedback": "ef"})]
    else:
        rate, steps = cfg.clients_per_round / clients, cfg.num_server_rounds
        methods = [{"name": "non-private FedAvg, fp32", "dp": "none", "codec": "none",
                    "feedback": "none", "norm-bound": 3.0}]
        uplinks = [("fp32", {"codec": "none", "feedback": "none"}),
                   ("shared Rand-K 10% + 8-bit", {"codec": "quant:bits=8", "feedback": "none",
                                                  "shared-randk": 0.1})]
    accounting = {}
    for eps in epsilons:
        sigma = noise_multiplier_for(eps, DELTA, rate, steps, "pld")
        for label, settings in uplinks:
            name = f"{part}-level eps={eps:g}, {label}"
            methods.append({"name": name, "dp": part, "dp-noise-multiplier": round(sigma, 4),
                            "dp-target-epsilon": eps, **settings,
                            **({"dp-adaptive-clip": True} if part == "client" else {})})
            accounting[name] = (rate, steps, round(sigma, 4))
    print(f"{part} level: {clients} clients; the most exposed participant has sampling rate "
          f"{rate:.4f} and {steps} steps", flush=True)
    return Sweep(base=base, grid={"seed": [0]}, methods=methods, num_supernodes=clients,
                 name=f"dp-{part}"), accounting


def to_toml(sweep: Sweep) -> str:
    def value(v):
        return json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(
            v, bool) else repr(v)

    lines = ["# Generated by experiments/dp_tradeoff.py: noise multipliers for each target",
             "# epsilon from the PLD accountant. Rerun the script to change them.",
             "[base]"]
    lines += [f"{k} = {value(v)}" for k, v in sweep.base.items()]
    lines += ["", "[grid]"] + [f"{k} = [{', '.join(value(x) for x in v)}]"
                               for k, v in sweep.grid.items()]
    lines += ["", "[simulation]", f"num-supernodes = {sweep.num_supernodes}"]
    for method in sweep.methods:
        lines += ["", "[[method]]"] + [f"{k} = {value(v)}" for k, v in method.items()]
    return "\n".join(lines) + "\n"


def bytes_per_update(run_dir: Path) -> float:
    """Mean payload bytes of an accepted update (the operator's rounds.csv)."""
    with open(run_dir / "rounds.csv") as handle:
        rows = list(csv.DictReader(handle))
    updates = sum(int(r["clients_ok"]) for r in rows)
    return sum(int(r["uplink_bytes"]) for r in rows) / updates if updates else math.nan


def report(sweep: Sweep, out: Path, accounting: dict) -> list[dict]:
    rows = []
    for run in sweep.runs:
        name = run.values["method"]
        path = out / run.run_id / "summary.json"
        if not path.exists():
            rows.append({"method": name, "status": "not run"})
            continue
        summary = json.loads(path.read_text())
        per_update = bytes_per_update(out / run.run_id)
        row = {"method": name, "status": "ok", "final_accuracy": summary["final_accuracy"],
               "best_accuracy": summary["best_accuracy"], "bytes_per_update": per_update,
               "x_fp32": summary["model_bytes_fp32"] / per_update,
               "rounds": summary["rounds_completed"]}
        if name in accounting:
            rate, steps, sigma = accounting[name]
            target = run.config.dp_target_epsilon
            row.update({"target_epsilon": target, "sigma": sigma,
                        "epsilon_pld": summary["epsilon"],
                        "epsilon_rdp_same_sigma": epsilon_of([(sigma, rate, steps)], DELTA,
                                                             "rdp"),
                        "sigma_rdp_needed": noise_multiplier_for(target, DELTA, rate, steps,
                                                                 "rdp")})
        rows.append(row)
    fp32 = {r.get("target_epsilon"): r["final_accuracy"] for r in rows
            if r["status"] == "ok" and r["method"].endswith("fp32")}
    for r in rows:
        if r["status"] == "ok":
            r["vs_dp_fp32"] = r["final_accuracy"] - fp32.get(r.get("target_epsilon"), math.nan)
            r["vs_non_private"] = r["final_accuracy"] - fp32.get(None, math.nan)
    return rows


def print_table(rows: list[dict]) -> None:
    def f(value, spec):
        return "-" if value is None or (isinstance(value, float) and math.isnan(value)) \
            else format(value, spec)

    print("\n| method | sigma (PLD) | epsilon PLD | epsilon RDP, same sigma | sigma RDP needs |"
          " bytes/update | x fp32 | final acc | best acc | vs DP fp32 | vs non-private |"
          "\n|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["status"] != "ok":
            print(f"| {r['method']} | {r['status']} |" + " |" * 10)
            continue
        print(f"| {r['method']} | {f(r.get('sigma'), '.3f')} | {f(r.get('epsilon_pld'), '.2f')}"
              f" | {f(r.get('epsilon_rdp_same_sigma'), '.2f')} | "
              f"{f(r.get('sigma_rdp_needed'), '.3f')} | {r['bytes_per_update']:,.0f} | "
              f"{r['x_fp32']:.1f} | {r['final_accuracy']:.4f} | {r['best_accuracy']:.4f} | "
              f"{f(100 * r['vs_dp_fp32'], '+.1f')} | {f(100 * r['vs_non_private'], '+.1f')} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("sample", "client"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epsilons", type=float, nargs="+")
    parser.add_argument("--clients", type=int)
    parser.add_argument("--report-only", action="store_true",
                        help="tabulate the runs already in OUT; run nothing")
    args = parser.parse_args()
    for key, value in FLOWER_ENV.items():
        os.environ.setdefault(key, value)
    clients = args.clients or CLIENTS[args.part]
    sweep, accounting = build_sweep(args.part, args.epsilons or EPSILONS[args.part], clients)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        (out / "sweep.toml").write_text(to_toml(sweep))
        run_sweep(sweep, out, flower_runner(ROOT))
    rows = report(sweep, out, accounting)
    columns = sorted({key for r in rows for key in r}, key=lambda k: (k != "method", k))
    with open(out / "dp_tradeoff.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    print_table(rows)
    print(f"\n{out / 'dp_tradeoff.csv'}")


if __name__ == "__main__":
    main()
