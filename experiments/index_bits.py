"""Bits per index of Top-K supports of real client updates: Rice against rows coding.

A layer's update does not scatter its large entries uniformly: they crowd into the
rows of the output units whose gradient was large. This measures what that is worth
for the index coding (:mod:`fedcomp.codecs.index_coding`) in the headline's setting:
Fashion-MNIST, the 28x28 CNN, 100 Dirichlet(0.3) clients, 10 a round, 1 local epoch
(SGD lr 0.05, momentum 0.9), plain FedAvg, no Flower. At the rounds in ``--at`` it
takes each sampled client's update, keeps the Top-K of each tensor listed below and
prints, per tensor and ratio, the bits per index of

* the entropy of a uniformly random support of that size (``log2 C(n, k) / k``),
* the code chosen without rows coding (``rice`` here: one parameter for the tensor),
* the code chosen with it (``rows``: row counts, then each row's gaps), and how often
  ``rows`` was the smaller,
* the row-conditional bound: the entropy of the row counts' histogram plus
  ``sum log2 C(row_length, count)``, which no code using rows alone can beat.

    .venv/bin/python experiments/index_bits.py [--rounds 20] [--at 5 10 20]

``--dataset digits`` runs on the small built-in dataset (tests).
"""

from __future__ import annotations

import argparse
from math import lgamma, log

import numpy as np
import torch

from fedcomp.codecs.index_coding import encode_indices
from fedcomp.codecs.sparsify import select_top_k
from fedcomp.data import dirichlet_clients
from fedcomp.models import build_model
from fedcomp.training import state_arrays, train_from

#: (tensor, Top-K ratio) pairs: the per-layer budgets of the headline's fedcomp methods.
CASES = [("fc1.weight", 0.004), ("fc1.weight", 0.01), ("conv2.weight", 0.1),
         ("fc2.weight", 0.1)]


def _log2_binomial(n: int, k: int) -> float:
    return (lgamma(n + 1) - lgamma(k + 1) - lgamma(n - k + 1)) / log(2)


def support_bits(update: np.ndarray, ratio: float) -> dict[str, float]:
    """Bits per index of the Top-``ratio`` support of ``update`` under each measure."""
    rows = update.reshape(update.shape[0], -1)
    n, row_length = rows.size, rows.shape[1]
    k = max(1, round(ratio * n))
    indices = select_top_k(rows, k)

    def coded(length: int) -> tuple[str, float]:
        meta, parts = encode_indices(indices, n, length)
        return meta["ix"], 8 * sum(p.nbytes for p in parts.values()) / k

    _, before = coded(0)
    scheme, now = coded(row_length)
    counts = np.bincount(indices // row_length, minlength=rows.shape[0])
    _, histogram = np.unique(counts, return_counts=True)
    p = histogram / histogram.sum()
    bound = (sum(_log2_binomial(row_length, int(c)) for c in counts)
             - float((histogram * np.log2(p)).sum())) / k
    return {"uniform": _log2_binomial(n, k) / k, "before": before, "now": now,
            "rows": float(scheme == "rows"), "bound": bound}


def main(argv: list[str] | None = None) -> dict[tuple[str, float, int], dict[str, float]]:
    """Print the table; return the mean bits per (tensor, ratio, round)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--at", type=int, nargs="+", default=[5, 10, 20])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset", default="fashion-mnist", choices=["fashion-mnist", "digits"])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data, _ = dirichlet_clients(args.dataset, args.clients, alpha=0.3, seed=args.seed)
    model = build_model(args.dataset, seed=args.seed)
    global_model = state_arrays(model)
    cases = [(name, ratio) for name, ratio in CASES if name in global_model]
    rng = np.random.default_rng(args.seed)
    results: dict[tuple[str, float, int], dict[str, float]] = {}
    print(f"{'round':>5s}  {'tensor':14s} {'Top-K':>6s}  {'uniform':>7s}  {'no rows':>7s}  "
          f"{'rows ok':>7s}  {'rows won':>8s}  {'bound':>6s}   (bits per index, client mean)")
    for rnd in range(1, args.rounds + 1):
        sampled = [int(c) for c in rng.choice(args.clients, args.per_round, replace=False)
                   if len(data[int(c)])]
        updates = {c: train_from(model, global_model, data[c].x, data[c].y, epochs=1,
                                 seed=c * 100_003 + rnd) for c in sampled}
        weights = np.array([len(data[c]) for c in sampled], dtype=np.float64)
        deltas = {c: {k: v - global_model[k] for k, v in trained.items()}
                  for c, trained in updates.items()}
        measured = {(name, ratio): [support_bits(deltas[c][name], ratio) for c in sampled]
                    for name, ratio in cases} if rnd in args.at else {}
        if sampled:  # plain FedAvg: the example-weighted mean of the updates
            global_model = {k: (global_model[k] + sum(
                w * deltas[c][k].astype(np.float64) for c, w in zip(sampled, weights, strict=True))
                / weights.sum()).astype(np.float32) for k in global_model}
        if rnd in args.at:
            for (name, ratio), rows in measured.items():
                mean = {key: float(np.mean([r[key] for r in rows])) for key in rows[0]}
                results[name, ratio, rnd] = mean
                print(f"{rnd:5d}  {name:14s} {100 * ratio:5.1f}%  {mean['uniform']:7.2f}  "
                      f"{mean['before']:7.2f}  {mean['now']:7.2f}  {100 * mean['rows']:7.0f}%  "
                      f"{mean['bound']:6.2f}", flush=True)
    return results


if __name__ == "__main__":
    main()
