"""Would sending values on the server's last support beat a client's own Top-K?

Time-correlated sparsification (Ozfatura et al., 2021) has clients send values on the
support of the server's last update, which they already know from the downlink, so
those values travel without indices (0.5 B each at 4 bits, against about 1.7 B for a
Top-0.3% value with its Rice-coded index). Whether that pays depends on how much of a
client's update lies on that support. This measures it in the headline's setting
(non-IID Fashion-MNIST, 100 clients, 10 a round, 1 local epoch, Top-0.3% + 4-bit + EF
up, Top-0.5% 4-bit down) for ``fc1.weight`` (95% of the parameters): the share of the
energy of the vector each client compresses (delta + residual) that lies

* on its own Top-0.3% and Top-0.6% coordinates,
* on the support S of the server's last downlink update,
* on S plus its own Top-0.1% of the rest.

The rounds run in this process with fedcomp's client round and downlink, the plain
FedAvg mean and no Flower (only the overlap is measured here, not accuracy).

    .venv/bin/python experiments/support_overlap.py [--rounds 40] [--skip 10]

``--dataset digits`` runs the same measurement on the small built-in dataset (tests).
"""

from __future__ import annotations

import argparse

import numpy as np

from fedcomp.client_round import ClientState, model_shapes, run_client_round
from fedcomp.config import RunConfig
from fedcomp.data import load_partition
from fedcomp.downlink import Broadcaster
from fedcomp.models import build_model
from fedcomp.training import state_arrays
from fedcomp.wire import unpack_payload

TENSOR = "fc1.weight"


def main(argv: list[str] | None = None) -> np.ndarray:
    """Print the running means each round; return the last ones (four shares)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--skip", type=int, default=10, help="rounds before measuring")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--dataset", default="fashion-mnist", choices=["fashion-mnist", "digits"])
    args = parser.parse_args(argv)
    cfg = RunConfig(dataset=args.dataset, partitioning="dirichlet", dirichlet_alpha=0.3,
                    local_epochs=1, lr=0.05, momentum=0.9,
                    codec="topk:ratio=0.003|quant:bits=4", small_codec="fp16", feedback="ef",
                    downlink_codec="topk:ratio=0.005|quant:bits=4")
    shapes = model_shapes(cfg.task_name)
    server = Broadcaster(state_arrays(build_model(cfg.task_name, seed=cfg.seed)),
                         cfg.downlink_policy)
    states = {p: ClientState.fresh(cfg) for p in range(args.clients)}
    data: dict[int, object] = {}
    rng = np.random.default_rng(cfg.seed)
    uplink, downlink = cfg.uplink_policy.expected(shapes), cfg.downlink_policy.expected(shapes)
    shares: list[tuple[float, float, float, float]] = []
    means = np.full(4, np.nan)
    support: np.ndarray | None = None
    print("round  |S|  own top-0.3%  own top-0.6%  on S  S + own top-0.1%  (running means)")
    for rnd in range(1, args.rounds + 1):
        total: dict[str, np.ndarray] = {}
        for partition in (int(p) for p in rng.choice(args.clients, args.per_round,
                                                     replace=False)):
            if partition not in data:
                data[partition] = load_partition(cfg.task_name, partition, args.clients,
                                                 scheme="dirichlet", alpha=0.3, seed=cfg.seed)
            state = states[partition]
            message = server.message_for(state.replica.round or 0)
            result = run_client_round(cfg, state, message, data[partition],
                                      server_round=rnd, client_seed=partition)
            sent = unpack_payload(result.payload, expected=uplink).tensors
            # What was compressed: the sent (decoded) part plus the new residual.
            compressed = sent[TENSOR] + state.feedback.memory[TENSOR]
            energy = compressed.ravel().astype(np.float64) ** 2
            if support is not None and rnd > args.skip:
                k = int(0.003 * energy.size)
                ranked = np.sort(energy)[::-1]
                off_support = np.sort(energy[~support])[::-1]
                whole = energy.sum()
                shares.append((ranked[:k].sum() / whole, ranked[:2 * k].sum() / whole,
                               energy[support].sum() / whole,
                               (energy[support].sum() + off_support[:k // 3].sum()) / whole))
            for name, value in sent.items():
                total[name] = total.get(name, 0.0) + value.astype(np.float64)
        server.publish({name: server.model[name] + (total[name] / args.per_round)
                        .astype(np.float32) for name in total})
        last = unpack_payload(server.updates[server.round - 1], expected=downlink).tensors
        support = last[TENSOR].ravel() != 0
        if shares:
            means = np.mean(shares, axis=0)
            print(f"{rnd:5d}  {int(support.sum()):4d}  " + "  ".join(
                f"{m:12.3f}" for m in means), flush=True)
    return means


if __name__ == "__main__":
    main()
