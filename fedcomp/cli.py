"""``fedcomp`` command line: simulations, sweeps and reports.

    fedcomp simulate [--num-supernodes 10] [--run-config "key=value ..."]
    fedcomp sweep experiments/sweeps/smoke.toml --out results/smoke
    fedcomp report results/smoke [--target 0.9]

``simulate`` wraps Flower's own CLI (``flwr run . local``), because that is the path
users take and the one that must work: it starts (or reuses) the local SuperLink,
streams the run's log, then asks the SuperLink for the run's final status, since
``flwr run --stream`` exits 0 even when the run failed. It exits 1 unless the status
is ``finished:completed``, and ends with the run's summary table from
``summary.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["flower_env", "main"]

FLOWER_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "HF_HUB_OFFLINE": "1",
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
}


def flower_env(project: Path) -> dict[str, str]:
    """The environment for Flower commands: no telemetry, no installs, local FLWR_HOME."""
    env = dict(os.environ)
    for key, value in FLOWER_ENV.items():
        env.setdefault(key, value)
    env.setdefault("FLWR_HOME", str(project / ".flwr"))
    return env


def _flwr() -> str:
    candidate = Path(sys.executable).with_name("flwr")
    return str(candidate) if candidate.exists() else (shutil.which("flwr") or "flwr")


def _run_json(args: list[str], env: dict[str, str]) -> dict:
    proc = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise SystemExit(f"error: `{' '.join(args[:4])} ...` failed (exit {proc.returncode}):"
                         f"\n{proc.stdout}\n{proc.stderr}") from None


def simulate(args: argparse.Namespace) -> int:
    from fedcomp.results import format_summary_table

    project = Path(args.app).resolve()
    env = flower_env(project)
    results_dir = Path(args.results_dir).resolve()
    run_name = args.run_name or time.strftime("run-%Y%m%d-%H%M%S")
    run_config = " ".join(filter(None, [
        args.run_config, f"results-dir='{results_dir}'", f"run-name='{run_name}'"]))
    federation = (f"num-supernodes={args.num_supernodes} "
                  f"client-resources-num-cpus={args.cpus_per_client}")
    flwr = _flwr()
    started = _run_json([flwr, "run", str(project), args.connection, "--format", "json",
                         "--federation-config", federation, "--run-config", run_config], env)
    if not started.get("success"):
        print(f"error: flwr run failed: {started}", file=sys.stderr)
        return 1
    run_id = str(started["run-id"])
    print(f"fedcomp: started Flower run {run_id} ({args.num_supernodes} SuperNodes)",
          flush=True)
    subprocess.run([flwr, "log", run_id, args.connection, "--stream"], env=env, check=False)
    status = ""
    for _ in range(60):  # the log stream can end a moment before the status is final
        listing = _run_json([flwr, "ls", args.connection, "--run-id", run_id,
                             "--format", "json"], env)
        status = listing.get("runs", [{}])[0].get("status", "")
        if status.startswith("finished"):
            break
        time.sleep(1)
    if status != "finished:completed":
        print(f"error: Flower run {run_id} ended with status {status!r}; see the log above",
              file=sys.stderr)
        return 1
    summary_path = results_dir / run_name / "summary.json"
    if not summary_path.exists():
        print(f"error: the run completed but wrote no {summary_path}", file=sys.stderr)
        return 1
    print("\n" + format_summary_table([json.loads(summary_path.read_text())]))
    print(f"\nresults: {summary_path.parent} (rounds.csv, summary.json)")
    return 0


def sweep(args: argparse.Namespace) -> int:
    from fedcomp.sweep import Sweep, run_sweep

    plan = Sweep.load(args.file)
    print(f"sweep {plan.name}: {len(plan.runs)} runs x {plan.num_supernodes} clients -> "
          f"{args.out}", flush=True)

    def runner(config, num_supernodes):
        # Imported here: running simulations needs Flower, the sweep logic does not.
        from server.simulation import simulate

        summary, _ = simulate(config, num_supernodes=num_supernodes, verbose=args.verbose)
        return summary

    for key, value in FLOWER_ENV.items():
        os.environ.setdefault(key, value)
    rows = run_sweep(plan, args.out, runner)
    failed = [r for r in rows if r["status"] == "failed"]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} runs complete; "
          f"{Path(args.out) / 'runs.csv'}" + (f"; {len(failed)} failed" if failed else ""))
    return 1 if failed else 0


def report(args: argparse.Namespace) -> int:
    from fedcomp.report import write_report

    table, paths = write_report(args.dir, args.target)
    print(table)
    print("\n" + "\n".join(f"wrote {p}" for p in [*paths, Path(args.dir) / "report.md"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedcomp", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    sim = commands.add_parser("simulate", help="run the Flower simulation (flwr run . local)")
    sim.add_argument("--app", default=".", help="the Flower app folder (default: .)")
    sim.add_argument("--connection", default="local", help="SuperLink connection name")
    sim.add_argument("--num-supernodes", type=int, default=10)
    sim.add_argument("--cpus-per-client", type=float, default=1)
    sim.add_argument("--run-config", default="", help="overrides: \"key=value key='text'\"")
    sim.add_argument("--run-name", default="", help="results folder name (default: time)")
    sim.add_argument("--results-dir", default="results")
    sim.set_defaults(handler=simulate)
    sw = commands.add_parser("sweep", help="run every combination of a sweep file")
    sw.add_argument("file", help="sweep TOML file ([base], [grid], [simulation])")
    sw.add_argument("--out", required=True, help="folder for the runs and runs.csv")
    sw.add_argument("--verbose", action="store_true", help="show Flower's own log")
    sw.set_defaults(handler=sweep)
    rep = commands.add_parser("report", help="table and plots of a sweep folder")
    rep.add_argument("dir", help="a folder written by fedcomp sweep")
    rep.add_argument("--target", type=float, default=None,
                     help="target accuracy (default: best of codec=none runs - 0.01)")
    rep.set_defaults(handler=report)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
