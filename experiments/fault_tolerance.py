#!/usr/bin/env python
"""Attacked federations: accuracy and bytes under each defence.

    python experiments/fault_tolerance.py --dataset digits --out results/faults-digits
    python experiments/fault_tolerance.py --dataset digits --defences default clip3x \\
        --attacks labelflip --fractions 0.1 --seeds 0 1 2 3 --csv labelflip_seeds.csv \\
        --out results/faults-digits
    python experiments/fault_tolerance.py --dataset fashion-mnist --defences default none \\
        --fractions 0.1 --out results/faults-fashion

A fixed share of the clients (10% or 30%, chosen from the seed) attacks in every round
it trains, one way per run (:class:`fedcomp.federated.faults.AttackPlan`): ``signflip`` (its
update negated), ``scale`` (x1e6), ``fltmax`` (every float32 of its payload at the
float32 maximum), ``inflate`` (claims 1e9 examples), ``labelflip`` (trains on 9 - y).
Each attack runs under each defence:

* ``none``: no bound at all (``norm-bound = 0``, ``weight-cap = 0``), the weighted mean;
* ``default``: the run's defaults: updates clipped to 1.5x the round's median norm,
  example claims capped at 3x the round's median, the weighted mean;
* ``clip3x``: the same with a looser norm bound (3x the median);
* ``median``, ``trimmed`` (beta 0.2), ``krum`` (f 3, multi-Krum of 5): ``clip3x``
  with that robust rule instead of the mean.

and each defence also runs clean, so that its cost on a clean run shows. Runs are
Flower simulations of the sweep machinery (complete runs are skipped on a rerun). It
prints a table (final and best accuracy, means over ``--seeds``, the gap to the clean
default run and to the clean run of the same defence, uplink MB, updates rejected,
rounds skipped, each seed's final accuracy) and writes ``OUT/fault_tolerance.csv``
(or ``--csv``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedcomp.ops.cli import FLOWER_ENV, flower_runner  # noqa: E402
from fedcomp.ops.sweep import Sweep, run_sweep  # noqa: E402

ATTACKS = ["signflip", "scale", "fltmax", "inflate", "labelflip"]
DEFENCES = {
    "none": {"norm-bound": 0.0, "weight-cap": 0.0},
    "default": {},
    "clip3x": {"norm-bound": 3.0},
    # The robust rules were measured behind the looser 3x bound.
    "median": {"aggregation": "median", "norm-bound": 3.0},
    "trimmed": {"aggregation": "trimmed:beta=0.2", "norm-bound": 3.0},
    "krum": {"aggregation": "krum:f=3,m=5", "norm-bound": 3.0},
}
#: Per dataset: what differs from the run defaults (Fashion-MNIST: 50 local steps a
#: round, so that a run takes minutes rather than an hour on two cores).
#: The downlink is the full model: the defences measured are the uplink's. The runs keep
#: the JSON header they were recorded with.
BASES = {
    "digits": {"dataset": "digits", "num-server-rounds": 20, "downlink-codec": "none",
               "wire-header": "json"},
    "fashion-mnist": {"dataset": "fashion-mnist", "num-server-rounds": 20, "local-epochs": 0,
                      "local-steps": 50, "eval-every": 2, "downlink-codec": "none",
                      "wire-header": "json"},
}


def build_sweep(dataset: str, defences: list[str], attacks: list[str],
                fractions: list[float], clients: int, seeds: list[int] = (0,)) -> Sweep:
    methods = []
    for defence in defences:
        methods.append({"name": f"{defence} | clean", **DEFENCES[defence]})
        for attack in attacks:
            for fraction in fractions:
                methods.append({"name": f"{defence} | {attack} {fraction:.0%}",
                                **DEFENCES[defence], "attack": attack,
                                "attack-fraction": fraction})
    base = {**BASES[dataset], "fault-seed": 7}
    return Sweep(base=base, grid={"seed": list(seeds)}, methods=methods, num_supernodes=clients,
                 name=f"faults-{dataset}")


def _rounds(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "rounds.csv") as handle:
        return list(csv.DictReader(handle))


def collect(sweep: Sweep, out: Path) -> list[dict]:
    """One row per defence and scenario: means over the sweep's seeds (each seed's
    final accuracy listed too: the digits test split is 360 images, 0.28 points each)."""
    runs: dict[tuple[str, str], list[dict]] = {}
    for run in sweep.runs:
        defence, scenario = run.values["method"].split(" | ")
        path = out / run.run_id / "summary.json"
        if not path.exists():
            runs.setdefault((defence, scenario), []).append({})
            continue
        summary = json.loads(path.read_text())
        rounds = _rounds(out / run.run_id)
        runs.setdefault((defence, scenario), []).append({
            "seed": run.values["seed"],
            "final_accuracy": summary["final_accuracy"],
            "best_accuracy": summary["best_accuracy"],
            "uplink_mb": summary["uplink_bytes"] / 1e6,
            "rejected": summary["rejected_updates"],
            "rejected_by_reason": summary["rejected_by_reason"],
            "updates": sum(int(r["clients_ok"]) for r in rounds),
            "skipped_rounds": len(summary.get("skipped_rounds") or {}),
            "wall_s": summary["wall_s"]})
    rows = []
    for (defence, scenario), done in runs.items():
        if not all(done):
            rows.append({"defence": defence, "scenario": scenario, "status": "failed"})
            continue
        row = {"defence": defence, "scenario": scenario, "status": "ok",
               "seeds": len(done), "final_by_seed": [d["final_accuracy"] for d in done]}
        for key in ("final_accuracy", "best_accuracy", "uplink_mb", "wall_s"):
            row[key] = sum(d[key] for d in done) / len(done)
        for key in ("rejected", "updates", "skipped_rounds"):
            row[key] = sum(d[key] for d in done)
        reasons: dict[str, int] = {}
        for d in done:
            for reason, count in d["rejected_by_reason"].items():
                reasons[reason] = reasons.get(reason, 0) + count
        row["rejected_by_reason"] = reasons
        rows.append(row)
    clean = {r["defence"]: r["final_accuracy"] for r in rows
             if r["status"] == "ok" and r["scenario"] == "clean"}
    for r in rows:
        if r["status"] == "ok":
            r["vs_clean_default"] = r["final_accuracy"] - clean.get("default", float("nan"))
            r["vs_clean_same_defence"] = r["final_accuracy"] - clean.get(r["defence"],
                                                                         float("nan"))
    return rows


def print_table(rows: list[dict]) -> None:
    print("\n| defence | scenario | final acc | best acc | vs clean default (pt) |"
          " vs clean, same defence (pt) | MB up | rejected | rounds skipped | final by seed |"
          "\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["status"] != "ok":
            print(f"| {r['defence']} | {r['scenario']} | failed |" + " |" * 7)
            continue
        print(f"| {r['defence']} | {r['scenario']} | {r['final_accuracy']:.4f} | "
              f"{r['best_accuracy']:.4f} | {100 * r['vs_clean_default']:+.1f} | "
              f"{100 * r['vs_clean_same_defence']:+.1f} | {r['uplink_mb']:.3f} | "
              f"{r['rejected']} | {r['skipped_rounds']} | "
              f"{' '.join(f'{a:.4f}' for a in r['final_by_seed'])} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", choices=sorted(BASES), default="digits")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--defences", nargs="+", choices=list(DEFENCES), default=list(DEFENCES))
    parser.add_argument("--attacks", nargs="+", choices=ATTACKS, default=ATTACKS)
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.1, 0.3])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="data seeds; the table shows means over them")
    parser.add_argument("--csv", default="fault_tolerance.csv",
                        help="the table's file name in --out")
    args = parser.parse_args(argv)
    for key, value in FLOWER_ENV.items():
        os.environ.setdefault(key, value)
    sweep = build_sweep(args.dataset, args.defences, args.attacks, args.fractions, args.clients,
                        args.seeds)

    args.out.mkdir(parents=True, exist_ok=True)
    run_sweep(sweep, args.out, flower_runner(ROOT))
    rows = collect(sweep, args.out)
    columns = sorted({k for r in rows for k in r}, key=lambda k: (k not in ("defence",
                                                                           "scenario"), k))
    with open(args.out / args.csv, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows({k: json.dumps(v) if isinstance(v, (dict, list)) else v
                          for k, v in r.items()} for r in rows)
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
