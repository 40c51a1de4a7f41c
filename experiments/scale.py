#!/usr/bin/env python
"""What the server holds per client, at 100, 1,000 and 10,000 clients.

With the per-client downlink the server must know every client's replica. It keeps
the payloads each client was sent (:class:`fedcomp.federated.downlink.HeldReplica`)
rather than a model per client, so its memory and checkpoints grow with the bytes
sent. This benchmark drives the server side of that downlink exactly as the strategy
does (sample, send each sampled client its catch-up, publish the next model) for a
federation of each size, in one process, and measures:

* the bytes held for clients (payload chains, replicas kept as models, base models),
  per client seen and as a share of the model;
* the peak memory the process allocated (``tracemalloc``) above the model itself;
* the checkpoint's size on disk (the project's checkpoint writer);
* the wall time per round (sending to the sampled clients, publishing).

The model is the task's (default: the Fashion-MNIST CNN, 421,642 parameters); the
server's model moves each round by a seeded random step (1% of its norm), which is
what sizes the catch-ups; training is not part of it (the Flower simulation at scale
is ``fedcomp simulate`` with ``num-supernodes``, see the README's "Scale").

    python experiments/scale.py [--clients 100 1000 10000] [--rounds 100] [--per-round 10]
        [--forget-after 0] [--json results/scale.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedcomp.codecs.policy import CompressionPolicy  # noqa: E402
from fedcomp.config import RunConfig  # noqa: E402
from fedcomp.federated.checkpoint import save_checkpoint  # noqa: E402
from fedcomp.federated.downlink import PerClientBroadcaster, Recipient  # noqa: E402
from fedcomp.tasks.models import build_model  # noqa: E402
from fedcomp.tasks.training import state_arrays  # noqa: E402

MB = 1e6


def measure(model: dict[str, np.ndarray], policy: CompressionPolicy, *, clients: int,
            rounds: int, per_round: int, forget_after: int, seed: int) -> dict:
    """One federation of ``clients``: the server's per-client state after ``rounds``."""
    rng = np.random.default_rng(seed)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    server = PerClientBroadcaster(model, policy, seed=seed, forget_after=forget_after)
    step = 0.01 * float(np.sqrt(sum(float(np.sum(v * v)) for v in model.values())))
    scale = step / np.sqrt(sum(v.size for v in model.values()))
    seen: set[int] = set()
    round_s = []
    messages = sent = 0
    for _ in range(rounds):
        start = time.perf_counter()
        for client in sorted(rng.choice(clients, size=min(per_round, clients), replace=False)):
            who = Recipient(node=int(client), key=f"partition-{client}", stream=int(client))
            nbytes = server.send(who).nbytes
            messages += nbytes > 0
            sent += nbytes
            server.applied(who)
            seen.add(int(client))
        target = {k: v + np.float32(scale) * rng.standard_normal(v.shape, dtype=np.float32)
                  for k, v in server.model.items()}
        server.publish(target)
        round_s.append(time.perf_counter() - start)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    memory = server.memory()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "checkpoint.npz"
        save_checkpoint(path, *server.state_dict())
        checkpoint = path.stat().st_size
    held = memory["chain_bytes"] + memory["dense_bytes"] + memory["base_bytes"]
    known = sum(h is not None for h in server.held.values())
    model_bytes = server.model_nbytes
    return {
        "clients": clients, "rounds": rounds, "per_round": per_round,
        "forget_after": forget_after, "clients_seen": len(seen), "clients_held": known,
        "forgotten": server.forgotten, "messages": messages,
        "sent_mb": sent / MB, "held_mb": held / MB, "chain_mb": memory["chain_bytes"] / MB,
        "dense_clients": memory["dense_clients"], "base_mb": memory["base_bytes"] / MB,
        "per_client_kb": held / max(known, 1) / 1e3,
        "per_client_of_model": held / max(known, 1) / model_bytes,
        "model_per_client_mb": len(seen) * model_bytes / MB,
        "peak_mb": (peak - base) / MB, "checkpoint_mb": checkpoint / MB,
        "round_s": float(np.mean(round_s)), "model_mb": model_bytes / MB,
    }


def print_table(rows: list[dict]) -> None:
    head = ("| clients | seen | held | held MB | per client | of model | a model each MB "
            "| peak MB | checkpoint MB | s/round |")
    print(head)
    print("|" + "---|" * head.count(" | ") + "---|")
    for r in rows:
        print(f"| {r['clients']:,} | {r['clients_seen']:,} | {r['clients_held']:,} "
              f"| {r['held_mb']:.1f} | {r['per_client_kb']:.1f} kB "
              f"| {r['per_client_of_model']:.1%} | {r['model_per_client_mb']:,.0f} "
              f"| {r['peak_mb']:.1f} | {r['checkpoint_mb']:.1f} | {r['round_s']:.2f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--forget-after", type=int, default=0)
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    cfg = RunConfig(dataset=args.dataset)
    model = state_arrays(build_model(cfg.task_name, seed=args.seed))
    policy = cfg.downlink_policy
    print(f"{cfg.task_name}: {sum(v.size for v in model.values()):,} parameters, "
          f"downlink {policy.description}, {args.rounds} rounds of {args.per_round} clients, "
          f"forget-after {args.forget_after}", flush=True)
    rows = []
    for clients in args.clients:
        row = measure(model, policy, clients=clients, rounds=args.rounds,
                      per_round=args.per_round, forget_after=args.forget_after,
                      seed=args.seed)
        rows.append(row)
        print(f"  {clients:,} clients: {row['held_mb']:.1f} MB held, "
              f"{row['round_s']:.2f} s a round", flush=True)
    print()
    print_table(rows)
    for r in rows:
        print(f"{r['clients']:,} clients: {r['held_mb'] * 1e3 / max(r['messages'], 1):.1f} kB "
              f"held per message sent; a model per client seen would be "
              f"{r['model_per_client_mb'] / max(r['held_mb'], 1e-9):.1f}x what is held")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
