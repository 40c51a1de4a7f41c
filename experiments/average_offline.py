"""Which average of the server's models should a run evaluate? Compared offline.

Server-side averaging (``server-average``) changes only what a run evaluates: the
clients train from the server's own model, so a run's trajectory of server models is
the same whatever the averaging. With every round's model saved
(``save-model-every = 1``, see ``experiments/sweeps/saved_models.toml``), any averaging
scheme can be replayed on the saved trajectory and evaluated, instead of one Flower
run per scheme per seed. The replay of ``ema:0.9`` is checked bit for bit against the
average the run itself saved, where it saved one.

Schemes (``t`` counts the server steps folded in so far, from 0):

* ``raw``: the server's own model (no averaging).
* ``ema:D``: ``fedcomp.federated.averaging.ModelAverage`` (what ``server-average = D`` runs):
  the decay ``min(D, (1 + t) / (10 + t))``, TensorFlow's warm-up.
* ``poly:E``: polynomial-decay averaging (Shamir and Zhang, 2013): the new model
  weighs ``(E + 1) / (t + 1 + E)``; ``poly:0`` is the uniform average of every model
  since round 1, larger ``E`` forgets faster (the window grows as ``t / (E + 1)``).
* ``tail:F``: the uniform average of the last ``ceil(F * round)`` rounds' models
  (tail averaging, Jain et al., 2018; SWA's uniform average with a window that grows
  with the run).

For each run and scheme it prints the accuracy at the evaluated rounds, the first
round each reaches ``--target`` and the uplink and total MB spent by then (from the
run's ``rounds.csv``), and writes ``average_offline.csv`` (one row per run, scheme and
evaluated round) into the folder for a notebook.

    .venv/bin/python experiments/average_offline.py RESULTS_DIR [--target 0.8885]
        [--from-round 60] [--every 5] [--scheme ema:0.9 --scheme poly:3 ...]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from fedcomp.federated.averaging import ModelAverage
from fedcomp.federated.checkpoint import load_model
from fedcomp.tasks.data import load_dataset
from fedcomp.tasks.models import build_model
from fedcomp.tasks.training import evaluate

DEFAULT_SCHEMES = ("raw", "ema:0.9", "ema:0.95", "ema:0.98", "poly:0", "poly:1", "poly:3",
                   "tail:0.25", "tail:0.5")


def averages(models: list[dict[str, np.ndarray]], scheme: str,
             wanted: set[int] | None = None) -> Iterator[dict[str, np.ndarray] | None]:
    """Yield the scheme's model after each round 1..len(models)-1 (models[0]: round 0).

    Rounds not in ``wanted`` (default: all) may yield None where a scheme computes
    each round's model from scratch (``tail``).
    """
    kind, _, arg = scheme.partition(":")
    if kind == "raw":
        yield from models[1:]
    elif kind == "ema":
        average = ModelAverage(float(arg), models[0])
        for model in models[1:]:
            average.update(model)
            yield average.value
    elif kind == "poly":
        eta = float(arg)
        value = {k: v.astype(np.float64) for k, v in models[0].items()}
        for t, model in enumerate(models[1:]):
            weight = (eta + 1.0) / (t + 1.0 + eta)
            for k in value:
                value[k] += weight * (model[k] - value[k])
            yield {k: v.astype(np.float32) for k, v in value.items()}
    elif kind == "tail":
        fraction = float(arg)
        for rnd in range(1, len(models)):
            if wanted is not None and rnd not in wanted:
                yield None
                continue
            window = models[max(1, rnd - math.ceil(fraction * rnd) + 1):rnd + 1]
            yield {k: np.mean([m[k] for m in window], axis=0, dtype=np.float64)
                   .astype(np.float32) for k in models[0]}
    else:
        raise ValueError(f"unknown scheme {scheme!r}: use raw, ema:D, poly:E or tail:F")


def method_names(results_dir: Path) -> dict[str, str]:
    """Run id -> method name, from the sweep folders' runs.csv files."""
    names = {}
    for runs_csv in results_dir.glob("**/runs.csv"):
        with open(runs_csv) as handle:
            for row in csv.DictReader(handle):
                names[row["run_id"]] = f"{row.get('method') or row['run_id']} (seed {row['seed']})"
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results_dir", type=Path)
    parser.add_argument("--target", type=float, default=0.8885)
    parser.add_argument("--from-round", type=int, default=60)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--scheme", action="append", dest="schemes")
    args = parser.parse_args()
    schemes = args.schemes or list(DEFAULT_SCHEMES)
    torch.set_num_threads(os.cpu_count() or 1)
    names = method_names(args.results_dir)
    rows_out = []
    for model_dir in sorted(args.results_dir.glob("**/models")):
        run_dir = model_dir.parent
        config = json.loads((run_dir / "summary.json").read_text())["config"]
        with open(run_dir / "rounds.csv") as handle:
            rounds = {int(r["round"]): r for r in csv.DictReader(handle)}
        last = max(rounds)
        models = [load_model(model_dir / f"round-{r:04d}.npz") for r in range(last + 1)]
        evaluated = [r for r in range(1, last + 1)
                     if r >= args.from_round and (r % args.every == 0 or r == last)]
        _, test = load_dataset(config["dataset"], config["data-dir"], config["test-fraction"],
                               config["seed"])
        net = build_model(config["dataset"], seed=config["seed"])
        name = names.get(run_dir.name, run_dir.name)
        print(f"\n{name}: {run_dir.name}, {last} rounds, target {args.target}")
        print(f"{'scheme':<10} {'best':>6} {'round':>5} {'up MB':>7} {'total MB':>8}  "
              + " ".join(f"r{r}" for r in evaluated[::2]))
        for scheme in schemes:
            curve = {}
            for rnd, value in enumerate(averages(models, scheme, set(evaluated)),
                                        start=1):
                if rnd in evaluated:
                    net.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in
                                         value.items()})
                    with torch.inference_mode():
                        curve[rnd] = evaluate(net, test.x, test.y)[0]
                    saved = model_dir / f"round-{rnd:04d}.average.npz"
                    if scheme == f"ema:{config['server-average']}" and saved.exists():
                        on_server = load_model(saved)
                        if any(not np.array_equal(on_server[k], value[k]) for k in value):
                            raise SystemExit(f"{scheme} replay differs from {saved}")
            hit = next((r for r in evaluated if curve[r] >= args.target), None)
            up = total = math.nan
            if hit is not None:
                up = int(rounds[hit]["cum_uplink_bytes"]) / 1e6
                total = up + int(rounds[hit]["cum_downlink_bytes"]) / 1e6
            print(f"{scheme:<10} {max(curve.values()):6.4f} {hit or '-':>5} {up:7.2f} "
                  f"{total:8.1f}  " + " ".join(f"{curve[r]:.4f}" for r in evaluated[::2]),
                  flush=True)
            rows_out += [{"run_id": run_dir.name, "method": name, "scheme": scheme,
                          "round": r, "accuracy": curve[r],
                          "cum_uplink_bytes": rounds[r]["cum_uplink_bytes"],
                          "cum_downlink_bytes": rounds[r]["cum_downlink_bytes"]}
                         for r in evaluated]
    out = args.results_dir / "average_offline.csv"
    with open(out, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows_out[0]) if rows_out else ["run_id"])
        writer.writeheader()
        writer.writerows(rows_out)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
