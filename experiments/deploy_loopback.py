"""Deployment vs simulation: wall time per round, and the bytes that really travel.

Runs the same config on this machine:

1. as a deployment on loopback (SuperLink with TLS and node authentication, one
   SuperNode per partition; ``fedcomp.ops.deploy.Loopback``), once per ClientApp
   mode (``warm``: one long-lived ClientApp per node; ``per-message``: Flower's
   process per message), with Flower's own ``message_size_mod`` logging every
   message's size;
2. as a simulation (``flwr.simulation.run_simulation``) with as many virtual nodes.

Then it prints wall seconds per round for all, the wire bytes per round and node
split into fedcomp's payloads and the protocol around them (as the relays counted them,
and as the run itself recorded them in ``rounds.csv``: the two must agree), per
SuperNode and round the bytes Flower's mod logged (incoming, outgoing) next to the
payload bytes fedcomp counted (``clients.csv``: ``downlink-bytes`` and
``payload-bytes``), and the bytes that really crossed loopback: each SuperNode dials
the SuperLink through a small counting TCP relay (no packet capture tool is installed
here).

    .venv/bin/python experiments/deploy_loopback.py [--rounds 5] [--nodes 2]
        [--clientapp warm per-message] [--dataset digits|fashion-mnist] [--json FILE]
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedcomp.ops.cli import FLOWER_ENV, flower_env  # noqa: E402
from fedcomp.ops.deploy import CLIENTAPP_MODES, Loopback  # noqa: E402

# Flower prints each log line twice (console and a timestamped copy): take the latter.
SIZE_LINE = re.compile(r"^\S+ \S+:INFO:(Incoming|Outgoing) message size: (\d+) bytes$", re.M)
# The warm worker's log: one line each, "<date> <time> flwr:INFO: ...".
WARM_SIZE_LINE = re.compile(
    r"^\S+ \S+ flwr:INFO: (Incoming|Outgoing) message size: (\d+) bytes$", re.M)


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


class CountingProxy:
    """A TCP relay that counts the bytes each way: what really crosses the network.

    Each SuperNode dials the SuperLink through its own relay, so the counts are per
    node and include everything: TLS records, HTTP, protobuf, heartbeats and polling.
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.up = 0    # node -> SuperLink
        self.down = 0  # SuperLink -> node
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for src, dst, field in ((client, upstream, "up"), (upstream, client, "down")):
                threading.Thread(target=self._pipe, args=(src, dst, field), daemon=True).start()

    def _pipe(self, src, dst, field: str) -> None:
        try:
            while chunk := src.recv(65536):
                with self.lock:
                    setattr(self, field, getattr(self, field) + len(chunk))
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(2)
                except OSError:
                    pass

    def snapshot(self) -> tuple[int, int]:
        with self.lock:
            return self.up, self.down


def run_deployment(work: Path, run_config: str, nodes: int, clientapp: str) -> dict:
    """One deployed run; the wire bytes of each node counted in total and per round.

    A round's wire bytes are those that crossed a node's relay between the moments the
    ServerApp wrote the previous round's and this round's row of ``rounds.csv``: the
    round's downlink message, the node's reply, and the polling and heartbeats between.
    """
    results = work / "results"
    deployment = Loopback(work / "deploy", flower_env(ROOT), nodes=nodes,
                          node_config={"log-message-size": "true"}, clientapp=clientapp)
    proxies = {i: CountingProxy(("127.0.0.1", deployment.port)) for i in range(nodes)}
    deployment.node_superlink = {i: p.address for i, p in proxies.items()}
    rounds_csv = results / "deployment" / "rounds.csv"
    with deployment:
        idle = {i: p.snapshot() for i, p in proxies.items()}  # connection set-up so far
        boundaries = [idle]
        with (work / "runner.log").open("w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "fedcomp.ops.cli", "deploy", "run", "--app", str(ROOT),
                 "--connection", deployment.connection, "--run-config", run_config,
                 "--run-name", "deployment", "--results-dir", str(results)],
                env=deployment.env, stdout=log, stderr=subprocess.STDOUT)
            while proc.poll() is None:
                done = len(_rows(rounds_csv)) if rounds_csv.exists() else 0
                if done >= len(boundaries):
                    boundaries.append({i: p.snapshot() for i, p in proxies.items()})
                time.sleep(0.05)
        if proc.returncode != 0:
            raise SystemExit(f"deployment run failed:\n"
                             f"{(work / 'runner.log').read_text()[-3000:]}")
        sizes = {}
        for node in range(nodes):
            # The ClientApp logs the sizes: in the SuperNode's log when Flower starts it
            # per message, in its own log when it is the warm worker.
            found = []
            for name, pattern in ((f"supernode-{node}", SIZE_LINE),
                                  (f"clientapp-{node}", WARM_SIZE_LINE)):
                path = deployment.log_path(name)
                if path.exists():
                    found += pattern.findall(path.read_text(errors="replace"))
            sizes[node] = [(kind, int(n)) for kind, n in found]
        wire = {i: tuple(a - b for a, b in zip(p.snapshot(), idle[i], strict=True))
                for i, p in proxies.items()}
    per_round = {node: [tuple(b - a for a, b in zip(before[node], after[node], strict=True))
                        for before, after in itertools.pairwise(boundaries)]
                 for node in range(nodes)}
    folder = results / "deployment"
    return {"rounds": _rows(folder / "rounds.csv"), "clients": _rows(folder / "clients.csv"),
            "sizes": sizes, "wire": wire, "wire_per_round": per_round}


def run_simulation(work: Path, run_config: str, nodes: int) -> Path:
    from flwr.common.config import parse_config_args

    from fedcomp.config import RunConfig
    from server.simulation import simulate

    for key, value in FLOWER_ENV.items():
        os.environ.setdefault(key, value)
    overrides = parse_config_args([run_config])
    cfg = RunConfig.from_mapping({**RunConfig().to_mapping(), **overrides,
                                  "results-dir": str(work / "results"),
                                  "run-name": "simulation"})
    simulate(cfg, num_supernodes=nodes, verbose=False)
    return work / "results" / "simulation"


def _protocol_per_round(result: dict, nodes: int) -> tuple[float, ...]:
    """Medians over rounds 2.. and nodes: wire, payload and protocol bytes, up then down.

    Protocol bytes are what crossed the wire beyond fedcomp's payloads: TLS, HTTP,
    Flower's message envelopes and metrics, polling and heartbeats.
    """
    samples: list[tuple[int, int, int, int]] = []
    for node in range(nodes):
        mine = {int(r["round"]): r for r in result["clients"]
                if int(float(r["partition-id"])) == node}
        for index, (up, down) in enumerate(result["wire_per_round"][node]):
            row = mine.get(index + 1)
            if index == 0 or row is None:  # round 1 carries start-up (the app bundle)
                continue
            samples.append((up, int(float(row["payload-bytes"])),
                            down, int(float(row["downlink-bytes"]))))
    if not samples:
        return (float("nan"),) * 6
    med = [statistics.median(column) for column in zip(*samples, strict=True)]
    protocol_up = statistics.median(u - p for u, p, _, _ in samples)
    protocol_down = statistics.median(d - p for _, _, d, p in samples)
    return med[0], med[1], protocol_up, med[2], med[3], protocol_down


def _product_per_round(result: dict) -> tuple[float, ...]:
    """What the run itself recorded (``rounds.csv``, counted by each node's warm worker
    from the kernel's TCP counters): medians over rounds 2.. of wire and protocol bytes
    per node, up then down; NaN where no node reported (Flower's process per message)."""
    samples = [(int(r["wire_up_bytes"]) / int(r["wire_nodes"]),
                int(r["protocol_up_bytes"]) / int(r["wire_nodes"]),
                int(r["wire_down_bytes"]) / int(r["wire_nodes"]),
                int(r["protocol_down_bytes"]) / int(r["wire_nodes"]))
               for r in result["rounds"][1:] if int(r.get("wire_nodes") or 0)]
    if not samples:
        return (float("nan"),) * 4
    return tuple(statistics.median(column) for column in zip(*samples, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--clientapp", nargs="+", choices=CLIENTAPP_MODES,
                        default=list(CLIENTAPP_MODES),
                        help="how the SuperNodes run the ClientApp (each one deployed)")
    parser.add_argument("--dataset", default="digits", choices=("digits", "fashion-mnist"))
    parser.add_argument("--run-config", default="",
                        help="more run-config keys (e.g. \"local-epochs=0 local-steps=50\")")
    parser.add_argument("--json", default="", help="also write the numbers here")
    args = parser.parse_args()
    from flwr.common.config import parse_config_args

    keys = {"dataset": args.dataset, "num-server-rounds": args.rounds, "local-epochs": 1,
            "min-clients": args.nodes, "downlink-codec": "topk:ratio=0.05|quant:bits=8",
            **(parse_config_args([args.run_config]) if args.run_config else {})}
    run_config = " ".join(
        f"{key}='{value}'" if isinstance(value, str)
        else f"{key}={str(value).lower() if isinstance(value, bool) else value}"
        for key, value in keys.items())
    deployed: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="fedcomp-deploy-") as tmp:
        work = Path(tmp)
        for mode in args.clientapp:
            deployed[mode] = run_deployment(work / mode, run_config, args.nodes, mode)
        sim_rounds = _rows(run_simulation(work, run_config, args.nodes) / "rounds.csv")

    # Round 1 includes start-up (processes, data loading): compare the rest.
    def walls(rounds: list[dict[str, str]]) -> list[float]:
        return [float(r["wall_s"]) for r in rounds[1:]]

    modes = list(deployed)
    print(f"{args.nodes} nodes, {args.rounds} rounds, {run_config}\n")
    print("| | " + " | ".join(f"deployed, {m} ClientApp (TLS, loopback)" for m in modes)
          + " | simulation |\n|---|" + "---|" * (len(modes) + 1))
    print(f"| wall s per round (rounds 2..{args.rounds}, median) | " + " | ".join(
        f"{statistics.median(walls(deployed[m]['rounds'])):.2f}" for m in modes)
        + f" | {statistics.median(walls(sim_rounds)):.2f} |")
    protocol = {m: _protocol_per_round(deployed[m], args.nodes) for m in modes}
    for index, (label, unit) in enumerate((("wire bytes up", "B"), ("of it payload", "B"),
                                           ("protocol bytes up", "B"),
                                           ("wire bytes down", "B"), ("of it payload", "B"),
                                           ("protocol bytes down", "B"))):
        print(f"| {label} per round and node (median, rounds 2..{args.rounds}) | "
              + " | ".join(f"{protocol[m][index]:,.0f} {unit}" for m in modes) + " | |")
    product = {m: _product_per_round(deployed[m]) for m in modes}
    for index, label in enumerate(("wire bytes up", "protocol bytes up", "wire bytes down",
                                   "protocol bytes down")):
        print(f"| {label} per round and node, as the run recorded it (rounds.csv, median) | "
              + " | ".join(f"{product[m][index]:,.0f} B" for m in modes) + " | |")
    print("| final accuracy | " + " | ".join(
        f"{float(deployed[m]['rounds'][-1]['accuracy']):.4f}" for m in modes)
        + f" | {float(sim_rounds[-1]['accuracy']):.4f} |")

    report: dict[str, object] = {"simulation_wall_s": walls(sim_rounds), "deployments": {}}
    for mode in modes:
        result = deployed[mode]
        print(f"\n{mode} ClientApp: message sizes (Flower's message_size_mod) against "
              "fedcomp's payloads")
        print("\n| node | round | Flower in (B) | fedcomp downlink payload (B) | in - payload |"
              " Flower out (B) | fedcomp uplink payload (B) | out - payload |")
        print("|---|---|---|---|---|---|---|---|")
        table = []
        for node in range(args.nodes):
            mine = [r for r in result["clients"] if int(float(r["partition-id"])) == node]
            # Round 1 starts with the partition query: align the train messages from
            # the last one back.
            incoming = [n for kind, n in result["sizes"][node] if kind == "Incoming"]
            outgoing = [n for kind, n in result["sizes"][node] if kind == "Outgoing"]
            if not incoming:
                print(f"| {node} | (Flower's process per message logged no sizes here) |")
                continue
            for row, size_in, size_out in zip(mine, incoming[-len(mine):],
                                              outgoing[-len(mine):], strict=False):
                down = int(float(row["downlink-bytes"]))
                up = int(float(row["payload-bytes"]))
                table.append({"node": node, "round": int(row["round"]), "flower_in": size_in,
                              "fedcomp_down": down, "flower_out": size_out, "fedcomp_up": up})
                print(f"| {node} | {row['round']} | {size_in:,} | {down:,} | "
                      f"{size_in - down:,} | {size_out:,} | {up:,} | {size_out - up:,} |")
        print("\n| node | wire bytes sent (TLS, all rounds) | fedcomp uplink payloads | "
              "wire bytes received | fedcomp downlink payloads |\n|---|---|---|---|---|")
        for node in range(args.nodes):
            mine = [r for r in result["clients"] if int(float(r["partition-id"])) == node]
            up = sum(int(float(r["payload-bytes"])) for r in mine)
            down = sum(int(float(r["downlink-bytes"])) for r in mine)
            sent, received = result["wire"][node]
            print(f"| {node} | {sent:,} | {up:,} | {received:,} | {down:,} |")
        report["deployments"][mode] = {  # type: ignore[index]
            "wall_s": walls(result["rounds"]), "messages": table,
            "per_round_median": dict(zip(
                ("wire_up", "payload_up", "protocol_up", "wire_down", "payload_down",
                 "protocol_down"), protocol[mode], strict=True)),
            # None (JSON null) where no node reported: NaN is not JSON.
            "recorded_per_round_median": dict(zip(
                ("wire_up", "protocol_up", "wire_down", "protocol_down"),
                (None if math.isnan(value) else value for value in product[mode]),
                strict=True)),
            "wire_per_round": {str(k): v for k, v in result["wire_per_round"].items()},
            "wire": {str(k): v for k, v in result["wire"].items()}}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
