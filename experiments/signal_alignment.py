"""How well does the mean of compressed client updates point where all clients point?

The server steps along the mean of ten sampled clients' decoded updates. What the
model needs is the *population* mean: the update all 100 clients would send from the
same global model, of which the sampled mean is already a noisy estimate (non-IID
data, 10% participation). This measures, in the headline's setting (Fashion-MNIST,
the 28x28 CNN, 100 Dirichlet(0.3) clients, 10 a round, 1 local epoch, SGD lr 0.05
momentum 0.9, plain FedAvg along the way, no Flower), at each round in ``--at``:

* ``cos(mean_t, mean_t-1)``: the sampled mean against the previous round's: how much
  of a round's mean is the sampling of that round;
* ``cos(sampled, population)``: the sampled mean (uncompressed) against the
  population mean, for which every client trains from the same global model;
* per codec spec, with each sampled client's update compressed once (no error
  feedback, a fresh residual): kB a client, and the cosine of the compressed mean to
  the sampled mean and to the population mean.

The population mean costs a full pass over all clients at each ``--at`` round.

    .venv/bin/python experiments/signal_alignment.py --rounds 60 --at 20 40 60 \\
        --codec "topk:ratio=0.004|ternary:mode=mean" --codec "lowrank:rank=1|quant:bits=4"

It is a one-shot measure: it leaves out error feedback, which delivers what a biased
codec drops later, and the server optimizer. RESULTS.md (session 9) compares it with
what the same codecs do in training. ``--dataset digits`` runs on the small built-in
dataset (tests).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np
import torch

from fedcomp.data import dirichlet_clients
from fedcomp.models import build_model
from fedcomp.policy import CompressionPolicy, encode_update
from fedcomp.training import state_arrays, train_from

DEFAULT_CODECS = ("topk:ratio=0.004|ternary:mode=mean", "topk:ratio=0.01|ternary:mode=mean",
                  "lowrank:rank=1|quant:bits=4", "lowrank:rank=2|quant:bits=4")


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine of two arrays (0 where either is zero)."""
    a64, b64 = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    norm = float(np.linalg.norm(a64) * np.linalg.norm(b64))
    return float(a64 @ b64) / norm if norm else 0.0


def weighted_mean(updates: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """The example-weighted mean FedAvg takes."""
    total = float(np.sum(weights))
    return sum(w * u.astype(np.float64) for u, w in zip(updates, weights, strict=True)) / total


def main(argv: list[str] | None = None) -> dict[int, dict[str, float]]:
    """Print the table; return, per measured round, every figure by name."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--at", type=int, nargs="+", default=[20, 40, 60])
    parser.add_argument("--codec", action="append", default=[],
                        help="a codec spec to measure (repeatable)")
    parser.add_argument("--tensor", default="fc1.weight")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset", default="fashion-mnist", choices=["fashion-mnist", "digits"])
    args = parser.parse_args(argv)
    codecs = args.codec or list(DEFAULT_CODECS)
    policies = {spec: CompressionPolicy(spec) for spec in codecs}  # bad specs fail here
    torch.set_num_threads(1)
    data, _ = dirichlet_clients(args.dataset, args.clients, alpha=0.3, seed=args.seed)
    sizes = np.array([len(d) for d in data], dtype=np.float64)
    model = build_model(args.dataset, seed=args.seed)
    global_model = state_arrays(model)
    if args.tensor not in global_model:
        raise SystemExit(f"--tensor {args.tensor!r} is not in the model; it has "
                         f"{', '.join(global_model)}")
    rng = np.random.default_rng(args.seed)
    codec_rng = np.random.default_rng([args.seed, 1])
    results: dict[int, dict[str, float]] = {}
    previous_mean: np.ndarray | None = None

    def local_update(client: int, rnd: int) -> dict[str, np.ndarray]:
        trained = train_from(model, global_model, data[client].x, data[client].y, epochs=1,
                             seed=client * 100_003 + rnd)
        return {k: v - global_model[k] for k, v in trained.items()}

    print(f"{'round':>5s}  {'codec':44s} {'kB':>7s}  {'cos sampled':>11s}  "
          f"{'cos population':>14s}   ({args.tensor}, no error feedback)")
    for rnd in range(1, args.rounds + 1):
        sampled = [int(c) for c in rng.choice(args.clients, args.per_round, replace=False)
                   if len(data[int(c)])]
        deltas = {c: local_update(c, rnd) for c in sampled}
        weights = sizes[sampled]
        updates = [deltas[c][args.tensor] for c in sampled]
        sampled_mean = weighted_mean(updates, weights)
        if rnd in args.at:
            population = weighted_mean(
                [deltas[c][args.tensor] if c in deltas else local_update(c, rnd)[args.tensor]
                 for c in range(args.clients) if len(data[c])],
                [sizes[c] for c in range(args.clients) if len(data[c])])
            row = {"cos_previous": (cosine(sampled_mean, previous_mean)
                                    if previous_mean is not None else float("nan")),
                   "cos_sampled_population": cosine(sampled_mean, population)}
            print(f"{rnd:5d}  {'(uncompressed)':44s} {'':>7s}  {1.0:11.3f}  "
                  f"{row['cos_sampled_population']:14.3f}   cos(mean_t, mean_t-1) "
                  f"{row['cos_previous']:.3f}")
            for spec, policy in policies.items():
                encoded = [encode_update({args.tensor: u}, policy, rng=codec_rng)
                           for u in updates]
                mean = weighted_mean([e.decoded[args.tensor] for e in encoded], weights)
                row[f"{spec} kB"] = float(np.mean([e.nbytes for e in encoded])) / 1e3
                row[f"{spec} cos_sampled"] = cosine(mean, sampled_mean)
                row[f"{spec} cos_population"] = cosine(mean, population)
                print(f"{rnd:5d}  {spec:44s} {row[f'{spec} kB']:7.2f}  "
                      f"{row[f'{spec} cos_sampled']:11.3f}  "
                      f"{row[f'{spec} cos_population']:14.3f}", flush=True)
            results[rnd] = row
        previous_mean = sampled_mean
        if sampled:  # plain FedAvg: the example-weighted mean of the updates
            global_model = {k: (global_model[k] + weighted_mean(
                [deltas[c][k] for c in sampled], weights)).astype(np.float32)
                for k in global_model}
    return results


if __name__ == "__main__":
    main()
