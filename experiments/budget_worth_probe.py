#!/usr/bin/env python
"""How a byte budget would split one update among tensors under each worth measure.

The budget's water-filling (:class:`fedcomp.codecs.budget.Allocator`) sends each
tensor the entries whose kept energy, times the tensor's weight, is worth their bits.
Which weight is right decides the split, and a training run per candidate takes
minutes; this probe shows the split of real updates in about a minute. It trains the
headline's model (non-IID Fashion-MNIST, 100 Dirichlet clients, alpha 0.3) with
plain FedAvg for a few rounds in one process, then for a few clients' next local
epoch allocates the budget under:

* ``energy``, ``adaptive``, ``relative`` and ``balanced``, the measures
  ``budget-worth`` offers (:func:`fedcomp.codecs.budget.worth_weights`; ``balanced``
  counts the log of each tensor's kept share, :class:`~fedcomp.codecs.budget.Allocator`
  with ``balanced``; the error-feedback probe below does not follow it);
* candidates that are not offered: ``fisher`` (each tensor's energy times its
  empirical Fisher, the mean squared minibatch gradient at the global model: what a
  unit of change costs or gains in loss there), ``fisher/ms`` (the same over the
  mean square of the fresh delta), ``size^-1/2`` (each tensor's energy over the
  square root of its number of entries, which favours small tensors), ``share``
  (each tensor's energy over its fresh delta's: the share of its own update kept,
  every tensor counted alike), ``output``
  (each tensor's energy times how much its update moves the model's outputs per
  unit of energy: ``|J d|^2 / |d|^2`` on a batch of the client's data, a
  Jacobian-vector product), ``coherence`` (each tensor's energy times the share of
  its clients' update energy that survives their mean, over the clients probed),
  ``within-client`` (the same over two updates of one client, each trained from
  the global model on half of its data: how much of the update is signal rather
  than minibatch noise).

It prints each tensor's share of entries sent (mean over the clients) beside the
hand-tuned configuration's (``fedcomp-best``): the split that reaches the target in
more seeds than the budget does (experiments/RESULTS.md, "One byte budget").

With ``--feedback-rounds R`` it follows the split with error feedback instead, as a
run makes it (:func:`feedback_probe`, about 9 minutes with ``--clients 4
--feedback-rounds 12``): a few clients, each taking part every ``--gap`` FedAvg
rounds, keep one residual per measure, and the mean share over their last R/2
rounds is printed.

    python experiments/budget_worth_probe.py [--warmup-rounds 20] [--clients 6] [--values ternary]
    python experiments/budget_worth_probe.py --clients 4 --feedback-rounds 12 [--gap 10]

Nothing is asserted: a probe reports, sweeps decide.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import numpy as np
import torch
from torch import nn

from fedcomp.codecs.budget import (
    VALUE_CHOICES,
    Allocator,
    TopKFamily,
    parse_budget,
    worth_weights,
)
from fedcomp.codecs.pipeline import Pipeline
from fedcomp.codecs.wire import OVERHEAD_BYTES
from fedcomp.tasks.data import dirichlet_clients
from fedcomp.tasks.models import build_model
from fedcomp.tasks.training import load_arrays, state_arrays, train

#: What fedcomp-best sends of each tensor up (Top-10% of conv2 and fc2, Top-0.5% of
#: fc1, every entry of the small tensors in 8 bits).
HAND_TUNED = {"conv1.weight": 1.0, "conv1.bias": 1.0, "conv2.weight": 0.1, "conv2.bias": 1.0,
              "fc1.weight": 0.005, "fc1.bias": 1.0, "fc2.weight": 0.1, "fc2.bias": 1.0}


def fedavg_round(model: nn.Module, data: Any, rng: np.random.Generator, rnd: int, *,
                 lr: float, momentum: float) -> None:
    """One round of plain FedAvg in place: 10 clients drawn from ``rng``, each trained
    one epoch from ``model``, which then takes their mean."""
    start = state_arrays(model)
    mean = {k: np.zeros_like(v) for k, v in start.items()}
    chosen = rng.choice(len(data), 10, replace=False)
    for client in chosen:
        load_arrays(model, start)
        train(model, data[client].x, data[client].y, lr=lr, momentum=momentum,
              seed=rnd * 1000 + int(client))
        for k, v in state_arrays(model).items():
            mean[k] += (v - start[k]) / len(chosen)
    load_arrays(model, {k: start[k] + mean[k] for k in start})


def warmed_up(*, warmup_rounds: int, seed: int, lr: float, momentum: float
              ) -> tuple[Any, nn.Module, np.random.Generator]:
    """The headline's clients, its model after ``warmup_rounds`` plain FedAvg rounds,
    and the generator that sampled them (the probes draw their clients from it)."""
    data, _ = dirichlet_clients("fashion-mnist", 100, alpha=0.3, seed=seed)
    model = build_model("fashion-mnist", seed=seed)
    rng = np.random.default_rng(seed)
    for rnd in range(warmup_rounds):
        fedavg_round(model, data, rng, rnd, lr=lr, momentum=momentum)
        print(f"  warm-up round {rnd + 1}/{warmup_rounds}", file=sys.stderr, flush=True)
    return data, model, rng


def budget_families(model: nn.Module, budget: str, values: str
                    ) -> tuple[float, dict[str, TopKFamily]]:
    """The payload bits ``budget`` leaves for values and positions, and each tensor's
    Top-K family with the value codings ``values`` names (``"auto"``: all of them;
    ``"ternary"``: the template's one sign bit and a scale)."""
    start = state_arrays(model)
    numel = sum(v.size for v in start.values())
    budget_bits = 8.0 * (parse_budget(budget).payload_bytes(numel) - OVERHEAD_BYTES)
    template = Pipeline.parse("topk|ternary:mode=mean")
    choices = VALUE_CHOICES if values == "auto" else ()
    return budget_bits, {k: TopKFamily(template, v.size, choices) for k, v in start.items()}


def empirical_fisher(model: nn.Module, x: np.ndarray, y: np.ndarray,
                     batch_size: int = 32) -> dict[str, float]:
    """Each parameter tensor's mean squared minibatch gradient at the model as it is."""
    loss_fn = nn.CrossEntropyLoss()
    sums = {name: 0.0 for name, _ in model.named_parameters()}
    batches = 0
    for start in range(0, len(y), batch_size):
        model.zero_grad()
        loss_fn(model(torch.from_numpy(x[start:start + batch_size])),
                torch.from_numpy(y[start:start + batch_size])).backward()
        for name, p in model.named_parameters():
            sums[name] += float(p.grad.pow(2).mean())
        batches += 1
    model.zero_grad()
    return {name: value / max(batches, 1) for name, value in sums.items()}


def output_gain(model: nn.Module, start: dict[str, np.ndarray],
                delta: dict[str, np.ndarray], x: np.ndarray) -> dict[str, float]:
    """Each tensor's ``|J d|^2 / |d|^2``: the squared change of the outputs (logits,
    summed over classes, mean over ``x``) that its update ``d`` alone makes at
    ``start``, to first order, per unit of its energy (1 for an all-zero update)."""
    from torch.func import functional_call, jvp

    params = {k: torch.from_numpy(v.copy()) for k, v in start.items()}
    inputs = torch.from_numpy(x)
    gains = {}
    for name, value in delta.items():
        flat = value.reshape(-1).astype(np.float64)
        energy = float(flat @ flat)
        if energy == 0:
            gains[name] = 1.0
            continue

        def outputs(tensor: torch.Tensor, name: str = name) -> torch.Tensor:
            return functional_call(model, {**params, name: tensor}, (inputs,))

        _, moved = jvp(outputs, (params[name],), (torch.from_numpy(value.copy()),))
        gains[name] = float(moved.double().pow(2).sum()) / len(x) / energy
    return gains


def coherence(deltas: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """Each tensor's ``|mean d|^2 / mean |d|^2`` over clients' updates ``deltas``: 1
    where they agree, ``1 / len(deltas)`` for orthogonal ones of equal size."""
    out = {}
    for name in deltas[0]:
        stack = np.stack([d[name].astype(np.float64) for d in deltas])
        spread = float(np.mean(np.sum(stack.reshape(len(deltas), -1) ** 2, axis=1)))
        out[name] = float(np.sum(stack.mean(axis=0) ** 2)) / spread if spread else 1.0
    return out


def measures(delta: dict[str, np.ndarray], fisher: dict[str, float],
             start: dict[str, np.ndarray], *,
             extra: dict[str, dict[str, float]] | None = None
             ) -> dict[str, dict[str, float]]:
    """The tensors' weights under each measure probed; ``extra``: measures computed
    elsewhere (:func:`output_gain`, :func:`coherence`), by name."""
    mean_square = {k: float(np.mean(np.square(v, dtype=np.float64))) or 1.0
                   for k, v in delta.items()}
    return {"energy": worth_weights("energy", delta),
            "adaptive": worth_weights("adaptive", delta),
            "relative": worth_weights("relative", delta, start),
            "fisher": {k: fisher[k] for k in delta},
            "fisher/ms": {k: fisher[k] / mean_square[k] for k in delta},
            "size^-1/2": {k: float(v.size) ** -0.5 for k, v in delta.items()},
            "share": {k: 1.0 / (v.size * mean_square[k]) for k, v in delta.items()},
            **{name: dict(weights) for name, weights in (extra or {}).items()}}


def probe(*, warmup_rounds: int, clients: int, budget: str, seed: int, lr: float,
          momentum: float, values: str = "auto") -> dict[str, dict[str, float]]:
    """Each measure's mean share of entries sent per tensor; ``values``: the value
    codings the budget chooses from (``"auto"``, as ``budget-values = "auto"``), or
    ``"ternary"`` only (``budget-values = "codec"`` with a ternary codec)."""
    data, model, rng = warmed_up(warmup_rounds=warmup_rounds, seed=seed, lr=lr,
                                 momentum=momentum)

    start = state_arrays(model)
    budget_bits, families = budget_families(model, budget, values)
    models = {k: family.models for k, family in families.items()}
    probed = []
    for client in rng.choice(len(data), clients, replace=False):
        load_arrays(model, start)
        fisher = empirical_fisher(model, data[client].x, data[client].y)
        train(model, data[client].x, data[client].y, lr=lr, momentum=momentum,
              seed=int(client))
        delta = {k: v - start[k] for k, v in state_arrays(model).items()}
        load_arrays(model, start)
        gains = output_gain(model, start, delta, data[client].x[:128])
        halves = []
        size = len(data[client].y)
        for part in (slice(0, size // 2), slice(size // 2, size)):
            load_arrays(model, start)
            train(model, data[client].x[part], data[client].y[part], lr=lr,
                  momentum=momentum, seed=int(client))
            halves.append({k: v - start[k] for k, v in state_arrays(model).items()})
        probed.append((delta, fisher, {"output": gains, "within-client": coherence(halves)}))
    across = coherence([delta for delta, _, _ in probed])
    shares: dict[str, dict[str, list[float]]] = {}
    for delta, fisher, extra in probed:
        for measure, weights in measures(delta, fisher, start,
                                         extra={**extra, "coherence": across}).items():
            for name, choice in Allocator(delta, models, weights).allocate(budget_bits).items():
                shares.setdefault(measure, {}).setdefault(name, []).append(
                    choice.count / delta[name].size)
        balanced = Allocator(delta, models, balanced=True).allocate(budget_bits)
        for name, choice in balanced.items():
            shares.setdefault("balanced", {}).setdefault(name, []).append(
                choice.count / delta[name].size)
    return {measure: {name: statistics.mean(values) for name, values in per.items()}
            for measure, per in shares.items()}


def send_with_feedback(delta: dict[str, np.ndarray], residual: dict[str, np.ndarray],
                       families: dict[str, TopKFamily], weights: dict[str, float],
                       budget_bits: float, *, rng: np.random.Generator
                       ) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """One budgeted update with error feedback, as a client sends it: the budget
    allocated to ``delta + residual`` under ``weights``, each tensor coded as its
    choice says. Returns each tensor's share of entries sent and the new residual
    (what the decoded payload did not carry)."""
    compensated = {k: delta[k] + residual[k] for k in delta}
    allocation = Allocator(compensated, {k: f.models for k, f in families.items()},
                           weights).allocate(budget_bits)
    shares, kept = {}, {}
    for name, choice in allocation.items():
        sent: Any = 0.0
        if choice.count:
            pipeline = families[name].with_choice(choice.count, choice.values)
            _, sent = pipeline.roundtrip(compensated[name], rng=rng)
        kept[name] = (compensated[name] - sent).astype(np.float32)
        shares[name] = choice.count / compensated[name].size
    return shares, kept


#: The measures the error-feedback probe follows (each with its own residuals).
FEEDBACK_MEASURES = ("energy", "adaptive", "relative", "fisher", "size^-1/2", "share")


def feedback_probe(*, warmup_rounds: int, clients: int, rounds: int, budget: str,
                   seed: int, lr: float, momentum: float, values: str = "auto",
                   gap: int = 10) -> dict[str, dict[str, float]]:
    """Each measure's mean share of entries sent per tensor over the second half of
    ``rounds`` rounds *with error feedback*, as a run sends them.

    One round's allocation (:func:`probe`) misses what decides a run's split: a
    tensor that sends little keeps the rest in its residual, which grows until its
    entries are worth their bits. Here ``clients`` fixed clients each train from
    the global model every round; under each measure each keeps its own residual,
    allocates the budget to its compensated update (delta plus residual), codes the
    chosen entries with the chosen value coding and keeps what they did not carry.
    Between two such rounds the global model moves by ``gap`` rounds of plain FedAvg
    of 10 sampled clients (a client of the headline's setting takes part every 10
    rounds on average), the same for every measure, so the measures see one
    trajectory.
    """
    data, model, rng = warmed_up(warmup_rounds=warmup_rounds, seed=seed, lr=lr,
                                 momentum=momentum)

    shapes = {k: v.shape for k, v in state_arrays(model).items()}
    budget_bits, families = budget_families(model, budget, values)
    probed = [int(c) for c in rng.choice(len(data), clients, replace=False)]
    residuals = {(m, c): {k: np.zeros(v, np.float32) for k, v in shapes.items()}
                 for m in FEEDBACK_MEASURES for c in probed}
    shares: dict[str, dict[str, list[float]]] = {}
    code_rng = np.random.default_rng(seed + 1)
    for rnd in range(rounds):
        start = state_arrays(model)
        for client in probed:
            load_arrays(model, start)
            fisher = empirical_fisher(model, data[client].x, data[client].y)
            train(model, data[client].x, data[client].y, lr=lr, momentum=momentum,
                  seed=(warmup_rounds + rnd * gap) * 1000 + client)
            delta = {k: v - start[k] for k, v in state_arrays(model).items()}
            weights = measures(delta, fisher, start)
            for measure in FEEDBACK_MEASURES:
                sent, residuals[(measure, client)] = send_with_feedback(
                    delta, residuals[(measure, client)], families, weights[measure],
                    budget_bits, rng=code_rng)
                for name, share in sent.items():
                    if rnd >= rounds // 2:
                        shares.setdefault(measure, {}).setdefault(name, []).append(share)
        load_arrays(model, start)
        for step in range(gap):
            fedavg_round(model, data, rng, warmup_rounds + rnd * gap + step, lr=lr,
                         momentum=momentum)
        print(f"  feedback round {rnd + 1}/{rounds}", file=sys.stderr, flush=True)
    return {measure: {name: statistics.mean(v) for name, v in per.items()}
            for measure, per in shares.items()}


def print_table(rows: dict[str, dict[str, float]]) -> None:
    names = list(HAND_TUNED)
    table = {"hand-tuned (fedcomp-best)": HAND_TUNED, **rows}
    width = max(len(m) for m in table)
    print("measure".ljust(width) + "".join(f"  {n:>12}" for n in names))
    for measure, shares in table.items():
        print(measure.ljust(width) + "".join(
            f"  {100 * shares.get(n, float('nan')):>11.3g}%" for n in names))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmup-rounds", type=int, default=20,
                        help="plain FedAvg rounds before the probe")
    parser.add_argument("--clients", type=int, default=6, help="updates probed")
    parser.add_argument("--budget", default="400x")
    parser.add_argument("--values", choices=("auto", "ternary"), default="auto",
                        help="value codings the budget picks from: all of budget-values = "
                             "'auto', or one sign bit and a scale (ternary) only")
    parser.add_argument("--feedback-rounds", type=int, default=0,
                        help="follow the split over this many rounds with error feedback "
                             "(each measure its own residuals) instead of one round "
                             "without it; the second half's mean is printed")
    parser.add_argument("--gap", type=int, default=10,
                        help="FedAvg rounds between two of a probed client's rounds "
                             "(with --feedback-rounds)")
    parser.add_argument("--seed", type=int, default=4, help="data split, model, sampling")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    args = parser.parse_args(argv)
    if args.warmup_rounds < 0 or args.clients < 1:
        parser.error("--warmup-rounds must be >= 0 and --clients >= 1")
    # One thread: torch's parallel reductions round differently with the thread count,
    # and the shares printed should be the same on every machine.
    torch.set_num_threads(1)
    if args.feedback_rounds < 0 or args.gap < 1:
        parser.error("--feedback-rounds must be >= 0 and --gap >= 1")
    common = dict(warmup_rounds=args.warmup_rounds, clients=args.clients,
                  budget=args.budget, seed=args.seed, lr=args.lr,
                  momentum=args.momentum, values=args.values)
    if args.feedback_rounds:
        rows: dict[str, Any] = feedback_probe(rounds=args.feedback_rounds, gap=args.gap,
                                              **common)
        how = (f"mean over {args.clients} clients' updates in their rounds "
               f"{args.feedback_rounds // 2 + 1}-{args.feedback_rounds} with error "
               f"feedback, {args.gap} FedAvg rounds apart, after {args.warmup_rounds} "
               f"FedAvg rounds")
    else:
        rows = probe(**common)
        how = f"mean over {args.clients} updates after {args.warmup_rounds} FedAvg rounds"
    print(f"Share of each tensor's entries a {args.budget} budget sends "
          f"({'ternary values' if args.values == 'ternary' else 'value codings auto'}), "
          f"by worth measure ({how})")
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
