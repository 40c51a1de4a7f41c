#!/usr/bin/env python
"""Accuracy of the default digits run under dropouts and poisoned clients.

    python experiments/fault_tolerance.py [--rounds 20] [--json results/faults.json]

Runs real Flower simulations (in process, 10 clients, the default config otherwise)
with 0%, 10% and 30% dropout per client and round, and with 10% poisoned clients
(valid updates scaled by 1e6) without and with the norm bound (3 x the round's
median update norm). Prints a table of final and best accuracy and what the server
rejected.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tomllib
from pathlib import Path

from fedcomp.config import RunConfig
from server.simulation import simulate

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = {
    "clean": {},
    "10% dropout": {"fault-dropout": 0.1},
    "30% dropout": {"fault-dropout": 0.3},
    "10% poisoned": {"fault-poison": 0.1},
    "10% poisoned + norm bound": {"fault-poison": 0.1, "norm-bound": 3.0},
    "clean + norm bound": {"norm-bound": 3.0},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "faults")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--only", nargs="*", help="run only these scenarios")
    args = parser.parse_args(argv)
    defaults = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    rows = []
    for name, overrides in SCENARIOS.items():
        if args.only and name not in args.only:
            continue
        cfg = RunConfig.from_mapping({
            **defaults["config"], **overrides, "num-server-rounds": args.rounds,
            "results-dir": str(args.out), "run-name": name.replace(" ", "_").replace("%", "pct")
            .replace("+", "and"), "fault-seed": 7})
        print(f"running {name} ...", file=sys.stderr, flush=True)
        summary, _ = simulate(cfg, num_supernodes=10)
        rows.append({"scenario": name, "final_accuracy": summary["final_accuracy"],
                     "best_accuracy": summary["best_accuracy"],
                     "rejected": summary["rejected_by_reason"],
                     "failed_replies": None, "wall_s": summary["wall_s"]})
        with open(Path(cfg.results_dir) / cfg.resolved_run_name / "rounds.csv") as handle:
            failed = sum(int(r["clients_failed"]) for r in csv.DictReader(handle))
        rows[-1]["failed_replies"] = failed
    print(f"\n{'scenario':28s} {'final acc':>9s} {'best acc':>9s} {'failed':>7s}  rejected")
    for r in rows:
        print(f"{r['scenario']:28s} {r['final_accuracy']:9.4f} {r['best_accuracy']:9.4f} "
              f"{r['failed_replies']:7d}  {r['rejected'] or '-'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
