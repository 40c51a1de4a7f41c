"""Deployment vs simulation: wall time per round, and the bytes that really travel.

Runs the same config twice on this machine:

1. as a deployment on loopback (SuperLink with TLS and node authentication, one
   SuperNode per partition; ``fedcomp.ops.deploy.Loopback``), with Flower's own
   ``message_size_mod`` logging every message's size on each SuperNode;
2. as a simulation (``flwr.simulation.run_simulation``) with as many virtual nodes.

Then it prints wall seconds per round for both, per SuperNode and round the bytes
Flower's mod logged (incoming, outgoing) next to the payload bytes fedcomp counted
(``clients.csv``: ``downlink-bytes`` and ``payload-bytes``), and the bytes that
really crossed loopback: each SuperNode dials the SuperLink through a small counting
TCP relay (no packet capture tool is installed here).

    .venv/bin/python experiments/deploy_loopback.py [--rounds 5] [--nodes 2]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
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


def run_deployment(work: Path, run_config: str, nodes: int, clientapp: str
                   ) -> tuple[Path, dict[int, list], dict[int, tuple[int, int]]]:
    results = work / "results"
    deployment = Loopback(work / "deploy", flower_env(ROOT), nodes=nodes,
                          node_config={"log-message-size": "true"}, clientapp=clientapp)
    proxies = {i: CountingProxy(("127.0.0.1", deployment.port)) for i in range(nodes)}
    deployment.node_superlink = {i: p.address for i, p in proxies.items()}
    with deployment:
        idle = {i: p.snapshot() for i, p in proxies.items()}  # connection set-up so far
        proc = subprocess.run(
            [sys.executable, "-m", "fedcomp.ops.cli", "deploy", "run", "--app", str(ROOT),
             "--connection", deployment.connection, "--run-config", run_config,
             "--run-name", "deployment", "--results-dir", str(results)],
            env=deployment.env, capture_output=True, text=True, timeout=1800, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"deployment run failed:\n{proc.stdout[-3000:]}\n{proc.stderr}")
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
    return results / "deployment", sizes, wire


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--clientapp", nargs="+", choices=CLIENTAPP_MODES,
                        default=list(CLIENTAPP_MODES),
                        help="how the SuperNodes run the ClientApp (each one deployed)")
    parser.add_argument("--json", default="", help="also write the numbers here")
    args = parser.parse_args()
    run_config = (f"dataset='digits' num-server-rounds={args.rounds} local-epochs=1 "
                  f"min-clients={args.nodes} downlink-codec='topk:ratio=0.05|quant:bits=8'")
    deployed: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="fedcomp-deploy-") as tmp:
        work = Path(tmp)
        for mode in args.clientapp:
            folder, sizes, wire = run_deployment(work / mode, run_config, args.nodes, mode)
            deployed[mode] = {"rounds": _rows(folder / "rounds.csv"), "sizes": sizes,
                              "wire": wire, "clients": _rows(folder / "clients.csv")}
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
            incoming = [n for kind, n in result["sizes"][node] if kind == "Incoming"]
            outgoing = [n for kind, n in result["sizes"][node] if kind == "Outgoing"]
            for row, size_in, size_out in zip(mine, incoming, outgoing, strict=False):
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
            "wire": {str(k): v for k, v in result["wire"].items()}}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
