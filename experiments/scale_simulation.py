#!/usr/bin/env python
"""A Flower simulation with thousands of clients: wall time, memory and checkpoints.

Runs ``fedcomp simulate`` (Flower's simulation engine through ``flwr run``) on
Fashion-MNIST split over ``--clients`` partitions, ``--per-round`` clients a round,
with the default per-client downlink and error feedback, and meanwhile samples the
resident memory of every Flower and Ray process on this machine once a second (from
``/proc``: Linux only). It prints one row per federation size: wall time, mean time
a round, peak memory of the whole simulation (server, simulation engine, Ray
workers, every client's kept state) and of the process that holds the ServerApp,
the checkpoint's size, final accuracy, and writes them to ``--json``.

    python experiments/scale_simulation.py --clients 1000 --rounds 100 --per-round 10 \\
        --json results/scale/simulation.json

Each client keeps its error-feedback residual and its replica in Flower's
``context.state``: in a simulation that is this machine's memory (about two models
per client that has trained); in a deployment it is each device's.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedcomp.ops.cli import FLOWER_ENV  # noqa: E402

#: Processes counted as the simulation's (matched in their command line).
_MARKERS = ("flwr", "flower", "ray::", "raylet", "gcs_server", "ray/", "default_worker")


def _rss_by_process() -> dict[int, tuple[str, int]]:
    """PID -> (command line, resident bytes) of this user's simulation processes."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace")
            if not any(m in cmdline for m in _MARKERS):
                continue
            for line in Path(entry.path, "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    found[int(entry.name)] = (cmdline, int(line.split()[1]) * 1024)
        except OSError:
            continue  # it ended meanwhile
    return found


class MemorySampler(threading.Thread):
    """Peak summed RSS of the simulation's processes, and of the ServerApp's process."""

    def __init__(self, interval: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.peak_total = 0
        self.peak_server = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            processes = _rss_by_process()
            self.peak_total = max(self.peak_total, sum(r for _, r in processes.values()))
            server = [r for cmd, r in processes.values() if "flwr-simulation" in cmd]
            self.peak_server = max(self.peak_server, max(server, default=0))
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def simulate(clients: int, rounds: int, per_round: int, eval_every: int, out: Path,
             extra: str) -> dict:
    """One ``fedcomp simulate`` run; its measurements."""
    name = f"clients-{clients}"
    config = (f"dataset='fashion-mnist' num-server-rounds={rounds} "
              f"clients-per-round={per_round} eval-every={eval_every} {extra}").strip()
    baseline = sum(r for _, r in _rss_by_process().values())
    sampler = MemorySampler()
    sampler.start()
    start = time.perf_counter()
    done = subprocess.run(
        [str(Path(sys.executable).parent / "fedcomp"), "simulate", "--app", str(ROOT),
         "--num-supernodes", str(clients), "--run-config", config, "--run-name", name,
         "--results-dir", str(out)],
        env={**os.environ, **FLOWER_ENV}, check=False)
    wall = time.perf_counter() - start
    sampler.stop()
    run = out / name
    if done.returncode != 0 or not (run / "summary.json").exists():
        raise RuntimeError(f"the simulation of {clients} clients failed "
                           f"(exit {done.returncode})")
    summary = json.loads((run / "summary.json").read_text())
    with open(run / "rounds.csv") as handle:
        rows = list(csv.DictReader(handle))
    round_s = [float(r["wall_s"]) for r in rows]
    checkpoint = run / "checkpoint.npz"
    return {
        "clients": clients, "rounds": len(rows), "per_round": per_round,
        "wall_min": wall / 60, "round_s": sum(round_s) / max(len(round_s), 1),
        "peak_gb": (sampler.peak_total - baseline) / 1e9,
        "server_peak_gb": sampler.peak_server / 1e9,
        "checkpoint_mb": checkpoint.stat().st_size / 1e6 if checkpoint.exists() else 0.0,
        "final_accuracy": summary["final_accuracy"],
        "uplink_mb": summary["uplink_bytes"] / 1e6,
        "downlink_mb": summary["downlink_bytes"] / 1e6,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1000])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--run-config", default="", help='more overrides: "key=value ..."')
    parser.add_argument("--out", type=Path, default=Path("results/scale"))
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    rows = []
    for clients in args.clients:
        rows.append(simulate(clients, args.rounds, args.per_round, args.eval_every,
                             args.out.resolve(), args.run_config))
    print("\n| clients | rounds | wall min | s/round | peak GB (all) | peak GB (server "
          "process) | checkpoint MB | final acc | up MB | down MB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['clients']:,} | {r['rounds']} | {r['wall_min']:.1f} | {r['round_s']:.2f} "
              f"| {r['peak_gb']:.2f} | {r['server_peak_gb']:.2f} | {r['checkpoint_mb']:.1f} "
              f"| {r['final_accuracy']:.4f} | {r['uplink_mb']:.2f} | {r['downlink_mb']:.2f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
