"""Where does a Top-K uplink lose accuracy? Quick in-process pilots, no Flower.

The headline's sparse configurations lose 2-3 points against FedAvg (experiments/
RESULTS.md). Finding out why needs variants a sweep cannot express (the same update
sent with and without error feedback, with fp32 or 4-bit values, retrained on its
support), so this script runs the headline's setting in one process: Fashion-MNIST,
the 28x28 CNN, 100 Dirichlet(0.3) clients, 10 a round, SGD lr 0.05 momentum 0.9
batch 32. Each round every sampled client trains with :func:`fedcomp.training.train`
from the global model, compresses its delta with :func:`fedcomp.policy.encode_update`
and its own error-feedback memory, and the server steps its
:class:`~fedcomp.server_opt.ServerOptimizer` with the example-weighted mean of the
decoded updates.

It is a pilot, not the benchmark: the downlink is the full model unless
``--downlink-codec`` is given, the sampling is its own seeded draw (not the sweep's),
and there is no Flower or fault path.
Use it to choose what to run through ``fedcomp sweep``.

    .venv/bin/python experiments/uplink_pilot.py --codec "topk:ratio=0.003|quant:bits=4" \\
        --server-optimizer adam --server-lr 0.01 --json pilot.json

``--feedback none`` drops error feedback. ``--overrides`` takes the run config's
``codec-overrides`` string. ``--conv2-codec`` sends ``conv2.weight`` in a second
payload with its own codec and memory (how the first per-layer pilots ran, before
overrides existed; both payloads are counted). ``--retrain-steps N`` picks each
client's Top-K support of delta + residual for the tensors whose codec starts with
``topk``, resets the other coordinates to the global model and trains N more steps on
the support only (gradients masked), so the kept values make up for the dropped ones.
``--shared-support R`` tries time-correlated sparsification (Ozfatura et al., 2021):
the server's support is the top R of its last mean update's magnitudes for
``--shared-tensors``; clients send their values there with ``--shared-codec`` and
no indices (a second payload, counted), and their own codec on the rest;
``--shared-feedback`` adds what the shared codec lost to the rest before the own codec
(with its error feedback) compresses it; ``--shared-random`` replaces the server's
support by a random one of the same size (a control). ``--shared-source step`` takes
the support from the server's last *step* (the model change, which a compressed
downlink sends, so clients already hold its support) instead of its mean update, and
``--shared-window W`` makes it the union of the last W rounds' supports: with R the
downlink's own Top-K ratio, that support costs the downlink nothing.
``--downlink-codec SPEC`` (with ``--downlink-overrides``) compresses the downlink as the
Flower strategy does (``--downlink-mode step``): the server steps its optimizer from the
shared model and sends the step through the codec with its error feedback, and counts
what each sampled client is sent to catch up (the updates it missed since it last
took part, replayed from round 0 the first time, or the full model where that is
smaller). ``--downlink-mode mean`` tries the other order: the server compresses the
*mean update* (with error feedback) and every side applies the server optimizer to the
decoded mean, so clients replicate the optimizer (its state counts as part of a full
model's price: three times the model for FedAdam). ``--downlink-mode catchup`` keeps
each client's replica on the server and sends a sampled client one payload, the codec
applied to the whole difference between the server's model and its replica (what is
not sent stays in that difference for next time), so a message costs the same however
many rounds the client missed (the Flower strategy's ``downlink-mode = "per-client"``,
fedcomp.downlink.PerClientBroadcaster, since session 10). The pilot then reports
downlink bytes too.
``--json`` is rewritten after every evaluation, so a pilot cut short leaves its curve.
``--dataset digits`` runs on the small built-in dataset (tests).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque

import numpy as np
import torch

from fedcomp.data import dirichlet_clients
from fedcomp.feedback import ErrorFeedback, NoFeedback
from fedcomp.models import build_model
from fedcomp.policy import CompressionPolicy, encode_update, parse_overrides
from fedcomp.server_opt import ServerOptimizer
from fedcomp.training import evaluate, state_arrays, train, train_from


def _topk_masks(delta: dict[str, np.ndarray], memory: ErrorFeedback | NoFeedback,
                policy: CompressionPolicy) -> dict[str, np.ndarray]:
    """Each Top-K tensor's support: the k largest magnitudes of delta + residual."""
    masks = {}
    residual = memory.memory if isinstance(memory, ErrorFeedback) else {}
    for name, value in delta.items():
        stages = policy.pipeline_for(value.shape, name).get_config()["stages"]
        if not stages or stages[0]["id"] != "topk":
            continue
        full = (value + residual.get(name, 0.0)).ravel()
        k = min(full.size, stages[0]["k"] or max(1, round(stages[0]["ratio"] * full.size)))
        mask = np.zeros(full.size, dtype=bool)
        mask[np.argpartition(np.abs(full), -k)[-k:]] = True
        masks[name] = mask.reshape(value.shape)
    return masks


def _retrain_on_support(model: torch.nn.Module, start: dict[str, np.ndarray],
                        trained: dict[str, np.ndarray], masks: dict[str, np.ndarray],
                        data, steps: int, seed: int) -> dict[str, np.ndarray]:
    """Train ``steps`` more steps with only the masked coordinates free to move."""
    weights = {k: np.where(masks[k], trained[k], start[k]) if k in masks else trained[k]
               for k in start}
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in weights.items()})
    params = dict(model.named_parameters())
    frozen = {k: torch.from_numpy(m) for k, m in masks.items()}
    hooks = [params[k].register_hook(lambda g, m=m: g * m) for k, m in frozen.items()]
    try:
        train(model, data.x, data.y, steps=steps, lr=0.05, momentum=0.9, seed=seed)
    finally:
        for hook in hooks:
            hook.remove()
    after = state_arrays(model)
    # The off-support part of the first pass still goes to the error-feedback memory.
    return {k: after[k] - start[k] + (np.where(masks[k], 0.0, trained[k] - start[k])
                                      if k in masks else 0.0) for k in start}


def main(argv: list[str] | None = None) -> list[tuple[int, float, int]]:
    """Run one pilot; return (round, accuracy, cumulative uplink bytes) per evaluation."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--codec", default="topk:ratio=0.003|quant:bits=4")
    parser.add_argument("--small-codec", default="fp16")
    parser.add_argument("--overrides", default="", help="as the run config's codec-overrides")
    parser.add_argument("--conv2-codec", default="")
    parser.add_argument("--feedback", default="ef", choices=["ef", "none"])
    parser.add_argument("--server-optimizer", default="sgd")
    parser.add_argument("--server-lr", type=float, default=1.0)
    parser.add_argument("--server-tau", type=float, default=1e-3)
    parser.add_argument("--server-lr-schedule", default="constant", choices=["constant", "cosine"])
    parser.add_argument("--server-lr-final", type=float, default=0.0)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--retrain-steps", type=int, default=0)
    parser.add_argument("--shared-support", type=float, default=0.0)
    parser.add_argument("--shared-codec", default="quant:bits=4")
    parser.add_argument("--shared-tensors", default="fc1.weight")
    parser.add_argument("--shared-feedback", action="store_true",
                        help="hand the shared codec's error to the own codec (error feedback)")
    parser.add_argument("--shared-source", default="mean", choices=["mean", "step"],
                        help="the support: Top-R of the server's mean update or of its step")
    parser.add_argument("--shared-window", type=int, default=1,
                        help="the union of the last W rounds' supports")
    parser.add_argument("--shared-random", action="store_true",
                        help="a fresh random support of the same size each round (control)")
    parser.add_argument("--downlink-codec", default="",
                        help="compress the downlink with this spec (default: full model)")
    parser.add_argument("--downlink-overrides", default="")
    parser.add_argument("--downlink-small-codec", default="",
                        help="the downlink's codec for small tensors (default: --small-codec,"
                             " as the Flower strategy does)")
    parser.add_argument("--downlink-mode", default="step", choices=["step", "mean", "catchup"])
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset", default="fashion-mnist", choices=["fashion-mnist", "digits"])
    parser.add_argument("--json", default="", help="write the arguments and curve here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data, test_set = dirichlet_clients(args.dataset, args.clients, alpha=0.3, seed=args.seed)
    model = build_model(args.dataset, seed=args.seed)
    global_model = state_arrays(model)
    policy = CompressionPolicy(args.codec, args.small_codec,
                               overrides=parse_overrides(args.overrides))
    conv2 = CompressionPolicy(args.conv2_codec) if args.conv2_codec else None
    memories: dict[tuple[int, str], ErrorFeedback | NoFeedback] = {}

    def memory(client: int, part: str) -> ErrorFeedback | NoFeedback:
        if (client, part) not in memories:
            memories[client, part] = (ErrorFeedback(part) if args.feedback == "ef"
                                      else NoFeedback())
        return memories[client, part]

    shared_policy = CompressionPolicy(args.shared_codec, args.shared_codec)
    shared_names = [n for n in args.shared_tensors.split(",") if n]
    support: dict[str, np.ndarray] = {}
    if args.shared_window < 1:
        raise SystemExit(f"--shared-window must be at least 1, not {args.shared_window}")
    recent: dict[str, deque[np.ndarray]] = {n: deque(maxlen=args.shared_window)
                                            for n in shared_names}
    server = ServerOptimizer(kind=args.server_optimizer, lr=args.server_lr, tau=args.server_tau,
                             schedule=args.server_lr_schedule, lr_final=args.server_lr_final,
                             total_steps=args.rounds)
    rng = np.random.default_rng(args.seed)
    uplink, curve, started = 0, [], time.perf_counter()
    downlink, down_sizes, last_seen = 0, [], {}
    if args.downlink_codec:
        down_policy = CompressionPolicy(args.downlink_codec,
                                        args.downlink_small_codec or args.small_codec,
                                        overrides=parse_overrides(args.downlink_overrides))
        down_feedback = ErrorFeedback("downlink")
        model_bytes = encode_update(global_model, CompressionPolicy("none"),
                                    rng=np.random.default_rng(0)).nbytes
        # A client that cannot replay gets the model (and, in mean mode, the server
        # optimizer's state it replicates: FedAdam/FedYogi keep two moments).
        moments = {"adam": 2, "yogi": 2, "momentum": 1}.get(args.server_optimizer, 0)
        full_bytes = model_bytes * (1 + (moments if args.downlink_mode == "mean" else 0))
        replicas: dict[int, dict[str, np.ndarray]] = {}  # catchup: what each client holds
        initial_model = {k: v.copy() for k, v in global_model.items()}
    for rnd in range(1, args.rounds + 1):
        total = {k: np.zeros(v.shape, dtype=np.float64) for k, v in global_model.items()}
        weight = 0
        for client in (int(c) for c in rng.choice(args.clients, args.per_round,
                                                  replace=False)):
            if len(data[client]) == 0:
                continue
            start = global_model
            if args.downlink_codec and args.downlink_mode == "catchup":
                replica = replicas.setdefault(client, {k: v.copy()
                                                       for k, v in initial_model.items()})
                sent = encode_update({k: global_model[k] - replica[k] for k in replica},
                                     down_policy, rng=np.random.default_rng(
                                         [args.seed, rnd, client, 0xD0]))
                for name, value in sent.decoded.items():
                    replica[name] += value
                downlink += sent.nbytes
                start = replica
            elif args.downlink_codec:  # catch up: the missed updates, or the full model
                missed = sum(down_sizes[last_seen.get(client, 0):])
                downlink += min(missed, full_bytes)
                last_seen[client] = len(down_sizes)
            trained = train_from(model, start, data[client].x, data[client].y,
                                 epochs=args.local_epochs, seed=client * 100_003 + rnd)
            delta = {k: trained[k] - start[k] for k in start}
            if args.retrain_steps > 0:
                masks = _topk_masks(delta, memory(client, "main"), policy)
                # The retraining pass shuffles with its own seed (as the recorded runs did).
                delta = _retrain_on_support(model, start, trained, masks,
                                            data[client], args.retrain_steps, client * 7 + rnd)
            decoded: dict[str, np.ndarray] = {}
            on_support = {}
            if support:
                values = {}
                for name, where in support.items():
                    flat = delta[name].reshape(-1).copy()
                    values[name] = flat[where]
                    flat[where] = 0.0  # the own codec sends the rest
                    delta[name] = flat.reshape(delta[name].shape)
                shared = encode_update(values, shared_policy,
                                       rng=np.random.default_rng([args.seed, client, rnd, 2]))
                uplink += shared.nbytes
                if args.shared_feedback:
                    # What the shared codec lost goes to the own codec and its memory.
                    for name, where in support.items():
                        delta[name].reshape(-1)[where] = values[name] - shared.decoded[name]
                for name, where in support.items():
                    full = np.zeros(delta[name].size, dtype=np.float32)
                    full[where] = shared.decoded[name]
                    on_support[name] = full.reshape(delta[name].shape)
            if conv2 is not None:
                extra = encode_update({"conv2.weight": delta.pop("conv2.weight")}, conv2,
                                      feedback=memory(client, "conv2"),
                                      rng=np.random.default_rng([args.seed, client, rnd, 1]))
                uplink += extra.nbytes
                decoded.update(extra.decoded)
            update = encode_update(delta, policy, feedback=memory(client, "main"),
                                   rng=np.random.default_rng([args.seed, client, rnd]))
            uplink += update.nbytes
            decoded.update(update.decoded)
            for name, value in decoded.items():
                value = np.asarray(value, dtype=np.float64) + on_support.get(name, 0.0)
                total[name] += len(data[client]) * value
            weight += len(data[client])
        if weight:
            mean = {k: (v / weight).astype(np.float32) for k, v in total.items()}
            previous = global_model
            if args.downlink_codec and args.downlink_mode == "mean":
                sent = encode_update(mean, down_policy, feedback=down_feedback,
                                     rng=np.random.default_rng([args.seed, rnd, 0xD0]))
                down_sizes.append(sent.nbytes)
                global_model = server.step(global_model, sent.decoded)
            elif args.downlink_codec and args.downlink_mode == "step":
                target = server.step(global_model, mean)
                sent = encode_update({k: target[k] - global_model[k] for k in global_model},
                                     down_policy, feedback=down_feedback,
                                     rng=np.random.default_rng([args.seed, rnd, 0xD0]))
                down_sizes.append(sent.nbytes)
                global_model = {k: (global_model[k] + sent.decoded[k]).astype(np.float32)
                                for k in global_model}
            else:
                global_model = server.step(global_model, mean)
            if args.shared_support > 0:
                for name in shared_names:
                    moved = (mean[name] if args.shared_source == "mean"
                             else global_model[name] - previous[name])
                    magnitude = np.abs(moved).ravel()
                    k = max(1, round(args.shared_support * magnitude.size))
                    if args.shared_random:  # control: a random support of the same size
                        chosen = np.random.default_rng(
                            [args.seed, rnd, 3]).choice(magnitude.size, k, replace=False)
                    else:  # argpartition's tie-breaking is what the recorded pilot used.
                        chosen = np.argpartition(magnitude, -k)[-k:]
                    recent[name].append(chosen)
                    support[name] = np.unique(np.concatenate(list(recent[name])))
        if rnd % args.eval_every == 0 or rnd == args.rounds:
            model.load_state_dict({k: torch.from_numpy(v.copy())
                                   for k, v in global_model.items()})
            accuracy, _ = evaluate(model, test_set.x, test_set.y)
            curve.append((rnd, accuracy, uplink) + ((downlink,) if args.downlink_codec else ()))
            down = (f"downlink {downlink / 1e6:7.2f} MB  " if args.downlink_codec else "")
            print(f"round {rnd:4d}  accuracy {accuracy:.4f}  uplink {uplink / 1e6:7.2f} MB "
                  f"({uplink / rnd / args.per_round / 1e3:.2f} kB a client)  {down}"
                  f"{time.perf_counter() - started:5.0f} s", flush=True)
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump({"args": vars(args), "curve": curve}, fh, indent=1)
    print(f"best accuracy {max(point[1] for point in curve):.4f}")
    return curve

if __name__ == "__main__":
    main()
