"""``fedcomp`` command line: simulations, sweeps and reports.

    fedcomp simulate [--num-supernodes 10] [--run-config "key=value ..."]
    fedcomp sweep experiments/sweeps/smoke.toml --out results/smoke
    fedcomp report results/smoke [--target 0.9] [--extra-target 0.8 ...] [--at-round 50 ...]
        [--reference METHOD] [--paired]
    fedcomp deploy certs|connection|superlink|register|supernode|run ...

``simulate`` wraps Flower's own CLI (``flwr run . local``), because that is the path
users take and the one that must work: it starts (or reuses) the local SuperLink,
streams the run's log, then asks the SuperLink for the run's final status, since
``flwr run --stream`` exits 0 even when the run failed. It exits 1 unless the status
is ``finished:completed``, and ends with the run's summary table from
``summary.json`` (the copy that the ServerApp prints at the end of its log is held
back, so the table appears once). ``sweep`` runs each of its runs the same way,
with the run's whole config in a TOML file (Flower's ``--run-config FILE.toml``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["flower_env", "flower_runner", "main"]

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
    # Flower's servers start helpers (flower-superexec, flwr-serverapp, flwr-clientapp)
    # by name: they must be found in this environment even if it is not activated.
    tools = str(Path(sys.executable).parent)
    if tools not in env.get("PATH", "").split(os.pathsep):
        env["PATH"] = tools + os.pathsep + env.get("PATH", "")
    return env


def _simulation_superlinks(proc: Path) -> Iterator[tuple[Path, list[str]]]:
    """The ``/proc`` entry and command line of every running ``flower-superlink
    --simulation`` (the SuperLinks ``flwr run ... local`` starts) that can be read."""
    for entry in proc.glob("[0-9]*"):
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile, or not ours to read
        args = [a.decode(errors="replace") for a in argv if a]
        if any(a.endswith("flower-superlink") for a in args) and "--simulation" in args:
            yield entry, args


def stale_local_superlinks(proc: Path = Path("/proc")) -> list[int]:
    """Flower's local SuperLinks whose files are gone: the process ids.

    ``flwr run . local`` starts a SuperLink on 127.0.0.1:39091 that keeps running
    after the command, with its database under the FLWR_HOME of the checkout that
    started it, and later ``flwr run ... local`` commands reuse it whatever their
    FLWR_HOME. When that checkout has been deleted (and cloned again at the same
    path), the SuperLink writes to files that no longer exist and the new checkout's
    runs fail. Such a SuperLink is recognised from ``/proc``: its ``--database`` file
    is missing, or is open only as a deleted file, or its working folder is deleted.
    """
    found = []
    for entry, args in _simulation_superlinks(proc):
        if "--database" not in args:
            continue
        try:
            database = args[args.index("--database") + 1]
            deleted = f"{database} (deleted)"
            links = [os.readlink(fd) for fd in (entry / "fd").iterdir()
                     if fd.is_symlink()]
            cwd = os.readlink(entry / "cwd")
        except (OSError, IndexError):
            continue  # gone meanwhile, or not ours to read
        if not os.path.exists(database) or deleted in links or cwd.endswith(" (deleted)"):
            found.append(int(entry.name))
    return sorted(found)


def foreign_local_superlinks(tools: str | Path | None = None,
                             proc: Path = Path("/proc")) -> list[tuple[int, str]]:
    """Flower's local SuperLinks started from another Python environment: (process
    id, the folder its ``flower-superlink`` runs from) of each.

    A run submitted to the local SuperLink is executed by the ``flwr-simulation`` that
    SuperLink starts, with the SuperLink's own interpreter: it imports ``fedcomp``
    (and torch, flwr) from the environment that started the SuperLink, not from the
    one that submitted the run. A SuperLink left running by another checkout's tests,
    ``make run`` or sweeps would therefore run this checkout's experiments with that
    checkout's code, silently. ``tools``: this environment's scripts folder (default:
    the running interpreter's). A SuperLink whose command line names its script
    without a folder cannot be placed and is not reported.
    """
    ours = Path(tools) if tools is not None else Path(sys.executable).parent
    same = {os.path.abspath(ours), os.path.realpath(ours)}
    found = []
    for entry, args in _simulation_superlinks(proc):
        folder = os.path.dirname(next(a for a in args if a.endswith("flower-superlink")))
        if folder and os.path.abspath(folder) not in same \
                and os.path.realpath(folder) not in same:
            found.append((int(entry.name), folder))
    return sorted(found)


def refuse_foreign_local_superlink(tools: str | Path | None = None,
                                   proc: Path = Path("/proc")) -> None:
    """Stop with a clear error where the local SuperLink belongs to another Python
    environment (:func:`foreign_local_superlinks`), before a run is submitted to it.

    Raises
    ------
    SystemExit
        Naming the SuperLink's process id and folder, and how to go on.
    """
    ours = Path(tools) if tools is not None else Path(sys.executable).parent
    foreign = foreign_local_superlinks(ours, proc)
    if not foreign:
        return
    pid, folder = foreign[0]
    raise SystemExit(
        f"error: Flower's local SuperLink (pid {pid}) was started from {folder}, not from "
        f"this environment ({ours}); a run submitted to it would import fedcomp from "
        f"that environment's checkout, not this one. Wait for its runs to finish, stop "
        f"it (kill {pid}), then run this again.")


def stop_stale_local_superlinks(proc: Path = Path("/proc"), *, wait_s: float = 10.0) -> list[int]:
    """Stop the local SuperLinks :func:`stale_local_superlinks` finds (SIGTERM, then
    SIGKILL after ``wait_s``), so that ``flwr run ... local`` starts a fresh one.
    Returns the process ids stopped."""
    stale = stale_local_superlinks(proc)
    for pid in stale:
        print(f"fedcomp: stopping Flower's local SuperLink (pid {pid}): its files are "
              "gone (its checkout was deleted); Flower starts a new one", flush=True)
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            continue
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and (proc / str(pid)).exists():
            time.sleep(0.1)
        if (proc / str(pid)).exists():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    return stale


def _flwr() -> str:
    from fedcomp.ops.deploy import flower_tool

    return flower_tool("flwr")


def _run_json(args: list[str], env: dict[str, str]) -> dict:
    proc = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise SystemExit(f"error: `{' '.join(args[:4])} ...` failed (exit {proc.returncode}):"
                         f"\n{proc.stdout}\n{proc.stderr}") from None


def simulate(args: argparse.Namespace) -> int:
    federation = (f"num-supernodes={args.num_supernodes} "
                  f"client-resources-num-cpus={args.cpus_per_client}")
    return _run_app(args, federation=federation, where=f"{args.num_supernodes} SuperNodes",
                    summary_required=True)


def _flower_run(project: Path, connection: str, run_config: str, *, federation: str | None,
                where: str, verbose: bool) -> tuple[str, str, list[str], list[str]]:
    """``flwr run`` the app, stream its log, and wait for the run's final status.

    ``run_config`` is Flower's ``--run-config``: ``"key=value ..."`` or a TOML file.
    Returns the run id, its status, and the lines :func:`_stream` held back.
    """
    env = flower_env(project)
    flwr = _flwr()
    if connection == "local":
        stop_stale_local_superlinks()
        refuse_foreign_local_superlink()
    command = [flwr, "run", str(project), connection, "--format", "json",
               "--run-config", run_config]
    if federation:
        command += ["--federation-config", federation]
    started = _run_json(command, env)
    if not started.get("success"):
        raise RuntimeError(f"flwr run failed: {started}")
    run_id = str(started["run-id"])
    print(f"fedcomp: started Flower run {run_id} ({where})", flush=True)
    with _stops_run_when_interrupted(flwr, run_id, connection, env):
        held_table, quiet_tail = _stream(run_id, connection, env, verbose=verbose)
    status = ""
    for _ in range(60):  # the log stream can end a moment before the status is final
        listing = _run_json([flwr, "ls", connection, "--run-id", run_id,
                             "--format", "json"], env)
        status = listing.get("runs", [{}])[0].get("status", "")
        if status.startswith("finished"):
            break
        time.sleep(1)
    return run_id, status, held_table, quiet_tail


@contextlib.contextmanager
def _stops_run_when_interrupted(flwr: str, run_id: str, connection: str,
                                env: dict[str, str]) -> Iterator[None]:
    """Stop Flower run ``run_id`` (``flwr stop``) if this command is interrupted
    (Ctrl-C or SIGTERM) while it waits on the run: the run does not belong to this
    process, and left alone it would go on training and writing its results folder."""
    def on_sigterm(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # as Ctrl-C is, so that one handler stops the run

    # Only the main thread may set handlers; elsewhere Ctrl-C still stops the run.
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if in_main else None
    try:
        yield
    except KeyboardInterrupt:
        print(f"\nfedcomp: interrupted; stopping Flower run {run_id}", file=sys.stderr,
              flush=True)
        if in_main:  # a second TERM must not cut the stop short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            stopped = subprocess.run([flwr, "stop", run_id, connection, "--format", "json"],
                                     env=env, capture_output=True, text=True, check=False,
                                     timeout=60)
            if stopped.returncode != 0:
                print(f"fedcomp: `flwr stop {run_id}` failed (exit {stopped.returncode}): "
                      f"{stopped.stdout.strip()} {stopped.stderr.strip()}", file=sys.stderr)
        except (OSError, subprocess.TimeoutExpired) as exc:
            print(f"fedcomp: could not stop Flower run {run_id}: {exc}", file=sys.stderr)
        raise
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


def _run_app(args: argparse.Namespace, *, federation: str | None, where: str,
             summary_required: bool) -> int:
    """``flwr run``, stream its log, then demand the status ``finished:completed``."""
    from fedcomp.ops.results import FP32_NOTE, format_summary_table

    results_dir = Path(args.results_dir).resolve()
    run_name = args.run_name or time.strftime("run-%Y%m%d-%H%M%S")
    run_config = " ".join(filter(None, [
        args.run_config, f"results-dir='{results_dir}'", f"run-name='{run_name}'"]))
    try:
        run_id, status, held_table, quiet_tail = _flower_run(
            Path(args.app).resolve(), args.connection, run_config, federation=federation,
            where=where, verbose=getattr(args, "verbose", False))
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if status != "finished:completed":
        if quiet_tail:
            print("fedcomp: the last lines of Flower's log:\n" + "\n".join(quiet_tail))
        if held_table:
            print("\n".join(held_table))
        print(f"error: Flower run {run_id} ended with status {status!r}; see the log above",
              file=sys.stderr)
        return 1
    summary_path = results_dir / run_name / "summary.json"
    if not summary_path.exists():
        if held_table:
            print("\n".join(held_table))
        if summary_required:
            print(f"error: the run completed but wrote no {summary_path}", file=sys.stderr)
            return 1
        print(f"fedcomp: run {run_id} finished:completed; its results are on the "
              f"SuperLink's machine in {summary_path.parent}")
        return 0
    print("\n" + format_summary_table([json.loads(summary_path.read_text())]))
    print(FP32_NOTE)
    print(f"\nresults: {summary_path.parent} (rounds.csv, clients.csv, summary.json)")
    return 0


class _TableFilter:
    """Holds back the summary table that the ServerApp prints at the end of its log.

    ``fedcomp simulate`` ends with the table itself (from ``summary.json``), so the
    log's copy is held back instead of showing it twice. The held block starts at the
    table's header line and ends at the ServerApp's ``results:`` line after it; a
    block that runs on longer than that is not the table and is let through.
    """

    HEADER = ("run", "codec", "rounds", "final", "acc", "best", "acc")
    MAX_HELD = 64

    def __init__(self) -> None:
        self.held: list[str] = []
        self.holding = False

    def feed(self, line: str) -> list[str]:
        """The lines to show now, given the next line of the log."""
        if not self.holding:
            if tuple(line.split()[:len(self.HEADER)]) == self.HEADER:
                self.holding, self.held = True, [line]
                return []
            return [line]
        self.held.append(line)
        if line.startswith("results: "):
            self.holding = False
        elif len(self.held) > self.MAX_HELD:
            released, self.held, self.holding = self.held, [], False
            return released
        return []


_ANSI = re.compile(r"\x1b\[[0-9;]*m")

#: Flower's messages that every fedcomp simulation triggers and that ask nothing of
#: the user (the federation size is fedcomp's --num-supernodes; fedcomp evaluates on
#: the server, not on clients).
_EXPECTED_WARNINGS = ("default simulated SuperNodes changed",
                      "fraction_evaluate is set to 0.0", "This is a deprecated feature",
                      "entirely in future versions", "Manually terminating ClientAppActor")


class _QuietLog:
    """Shows fedcomp's own lines of a Flower log and Flower's warnings and errors.

    A simulation's log holds every Flower INFO line (coloured, several per round) and
    fedcomp's one ``[round ...]`` line per round; a user wants the latter. Flower's
    WARNING and ERROR lines and anything that is not a Flower log line (tracebacks,
    ``print`` output) still show, less the warnings fedcomp's own setup triggers. The
    last lines held back are kept, for the caller to show when the run fails.
    """

    def __init__(self, keep: int = 40) -> None:
        self.recent: collections.deque[str] = collections.deque(maxlen=keep)
        self._in_expected_warning = False

    def feed(self, line: str) -> list[str]:
        plain = _ANSI.sub("", line)
        level = plain.split(":", 1)[0].strip() if ":" in plain[:12] else ""
        expected = any(text in plain for text in _EXPECTED_WARNINGS)
        if level in ("INFO", "DEBUG") or expected or (
                self._in_expected_warning and not level and plain.startswith(" ")) or \
                plain.startswith(("Using SuperLink:", "Successfully installed")) or \
                not plain.strip():
            if level:
                self._in_expected_warning = expected
            self.recent.append(line)
            return []
        self._in_expected_warning = False
        return [line]


def _stream(run_id: str, connection: str, env: dict[str, str], *,
            verbose: bool = False) -> tuple[list[str], list[str]]:
    """Echo the run's log as Flower streams it, less the ServerApp's summary table
    and, unless ``verbose``, less Flower's INFO lines (:class:`_QuietLog`).

    Returns the lines held back: the table's block, for the caller to show if it has
    no ``summary.json`` to print the table from, and the last quiet lines, for a run
    that failed.
    """
    table, quiet = _TableFilter(), _QuietLog()
    with subprocess.Popen([_flwr(), "log", run_id, connection, "--stream"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace") as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            for shown in table.feed(line.rstrip("\n")):
                for kept in ([shown] if verbose else quiet.feed(shown)):
                    print(kept, flush=True)
    return table.held, list(quiet.recent)


def _exec(argv: list[str], env: dict[str, str]) -> int:
    """Replace this process with a Flower server process (signals reach it directly)."""
    print("fedcomp: " + " ".join(argv), flush=True)
    os.execvpe(argv[0], argv, env)
    return 1  # not reached


def deploy(args: argparse.Namespace) -> int:
    from fedcomp.ops import deploy as dep

    project = Path(args.app).resolve() if hasattr(args, "app") else Path.cwd()
    env = flower_env(project)
    certs = None if getattr(args, "insecure", False) else dep.Certificates(
        Path(getattr(args, "certs", "") or "deploy/certs"))
    if certs is not None and args.action not in ("certs", "run") and not certs.ca_cert.exists():
        print(f"error: {certs.ca_cert} does not exist: run `fedcomp deploy certs` first, "
              "or pass --insecure for a test on one machine", file=sys.stderr)
        return 2
    if getattr(args, "insecure", False):
        print("fedcomp: WARNING: insecure mode (no TLS, no node authentication): for a "
              "test on one machine only", file=sys.stderr)
    if args.action == "certs":
        hosts = args.host or ["localhost", "127.0.0.1"]
        made = dep.make_certificates(args.certs, hosts=hosts, nodes=args.nodes)
        print(f"wrote CA, SuperLink certificate ({', '.join(hosts)}) and {args.nodes} node "
              f"key pairs to {made.folder} (private keys mode 0600)")
        return 0
    if args.action == "connection":
        path = dep.write_connection(env["FLWR_HOME"], args.name, args.address, certs)
        print(f"wrote connection {args.name!r} -> {args.address} to {path}")
        return 0
    if args.action == "superlink":
        return _exec(dep.superlink_argv(certs, host=args.host, port=args.port,
                                        database=args.database), env)
    if args.action == "register":
        assert certs is not None
        return subprocess.run([_flwr(), "supernode", "register",
                               str(certs.node_public_key(args.node)), args.connection],
                              env=env, check=False).returncode
    if args.action == "supernode":
        argv = dep.supernode_argv(
            certs, args.node, superlink=args.superlink, partition_id=args.partition_id,
            num_partitions=args.num_partitions, port=args.port, state_dir=args.state_dir,
            data_dir=args.data_dir, log_message_size=args.log_message_size,
            clientapp=args.clientapp)
        if args.clientapp == "warm":
            # The SuperNode replaces this process (same pid): the worker watches that pid
            # and exits with the node.
            worker = dep.clientapp_worker_argv(args.port, parent_pid=os.getpid(),
                                               superlink=args.superlink)
            print("fedcomp: " + " ".join(worker), flush=True)
            subprocess.Popen(worker, env=env)
        return _exec(argv, env)
    if args.action == "run":
        return _run_app(args, federation=None, where=f"connection {args.connection}",
                        summary_required=False)
    raise AssertionError(args.action)


def sweep(args: argparse.Namespace) -> int:
    from fedcomp.ops.report import encoder_of
    from fedcomp.ops.sweep import Sweep, run_sweep

    plan = Sweep.load(args.file)
    print(f"sweep {plan.name}: {len(plan.runs)} runs x {plan.num_supernodes} clients -> "
          f"{args.out}", flush=True)
    for notice in plan.notices:
        print(f"note: {notice}", flush=True)
    runner = flower_runner(Path(args.app), connection=args.connection,
                           cpus_per_client=args.cpus_per_client, verbose=args.verbose)
    rows = run_sweep(plan, args.out, runner, fingerprint=encoder_of)
    failed = [r for r in rows if r["status"] == "failed"]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} runs complete; "
          f"{Path(args.out) / 'runs.csv'}" + (f"; {len(failed)} failed" if failed else ""))
    return 1 if failed else 0


def flower_runner(app: Path, *, connection: str = "local", cpus_per_client: int = 1,
                  verbose: bool = False):
    """A runner for :func:`fedcomp.ops.sweep.run_sweep`: each run through ``flwr run`` on
    the local SuperLink, as ``fedcomp simulate`` runs it, with the run's whole config
    in a TOML file. It returns the run's summary and raises if the run failed."""
    import tempfile

    import tomli_w

    project = Path(app).resolve()

    def run(config, num_supernodes: int) -> dict:
        results_dir = Path(config.results_dir).resolve()
        # The preset is already expanded into the config's keys, some perhaps set back
        # to their defaults by the sweep: the apps get those keys without the preset's
        # name, as nodes get their settings (RunConfig.node_settings), so nothing can
        # expand it again and undo that.
        config = config.replace(results_dir=str(results_dir), preset="")
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "run-config.toml"
            path.write_text(tomli_w.dumps(config.to_mapping()))
            run_id, status, _, quiet_tail = _flower_run(
                project, connection, str(path),
                federation=(f"num-supernodes={num_supernodes} "
                            f"client-resources-num-cpus={cpus_per_client}"),
                where=f"{num_supernodes} SuperNodes", verbose=verbose)
        if status != "finished:completed":
            raise RuntimeError(f"Flower run {run_id} ended with status {status!r}; the "
                               "last lines of its log:\n" + "\n".join(quiet_tail[-15:]))
        return json.loads((results_dir / config.run_name / "summary.json").read_text())

    return run


def report(args: argparse.Namespace) -> int:
    from fedcomp.ops.report import current_encoder, write_report

    try:
        table, paths = write_report(args.dir, args.target, args.extra_target, args.at_round,
                                    args.reference, fingerprint=current_encoder,
                                    paired=args.paired, plot_methods=args.plot_method)
    except ValueError as exc:  # a reference that is not there, no FedAvg to pair with
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table)
    print("\n" + "\n".join(f"wrote {p}" for p in [*paths, Path(args.dir) / "report.md"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM; a Flower run waited on is stopped
        print("fedcomp: interrupted", file=sys.stderr)
        return 130


def presets(args: argparse.Namespace) -> int:
    from fedcomp.presets import describe

    print(describe())
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``fedcomp`` command line (every subcommand)."""
    parser = argparse.ArgumentParser(prog="fedcomp", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    sim = commands.add_parser("simulate", help="run the Flower simulation (flwr run . local)")
    sim.add_argument("--app", default=".", help="the Flower app folder (default: .)")
    sim.add_argument("--connection", default="local", help="SuperLink connection name")
    sim.add_argument("--num-supernodes", type=int, default=10)
    sim.add_argument("--cpus-per-client", type=int, default=1,
                     help="whole CPUs per virtual client (Flower 1.42 takes no fraction)")
    sim.add_argument("--run-config", default="", help="overrides: \"key=value key='text'\"")
    sim.add_argument("--run-name", default="", help="results folder name (default: time)")
    sim.add_argument("--results-dir", default="results")
    sim.add_argument("--verbose", action="store_true",
                     help="show Flower's whole log (default: one line per round, warnings)")
    sim.set_defaults(handler=simulate)
    sw = commands.add_parser("sweep", help="run every combination of a sweep file")
    sw.add_argument("file", help="sweep TOML file ([base], [grid], [simulation])")
    sw.add_argument("--out", required=True, help="folder for the runs and runs.csv")
    sw.add_argument("--app", default=".", help="the Flower app folder (default: .)")
    sw.add_argument("--connection", default="local", help="SuperLink connection name")
    sw.add_argument("--cpus-per-client", type=int, default=1,
                     help="whole CPUs per virtual client (Flower 1.42 takes no fraction)")
    sw.add_argument("--verbose", action="store_true",
                    help="show Flower's whole log (default: one line per round, warnings)")
    sw.set_defaults(handler=sweep)
    rep = commands.add_parser("report", help="table and plots of a sweep folder")
    rep.add_argument("dir", help="a folder written by fedcomp sweep")
    rep.add_argument("--target", type=float, default=None,
                     help="target accuracy for the plots and the first table (default: plain "
                          "FedAvg's mean best accuracy - 0.01)")
    rep.add_argument("--extra-target", type=float, action="append", default=[],
                     metavar="ACC", help="one more bytes-to-target table (repeatable)")
    rep.add_argument("--at-round", type=int, action="append", default=[], metavar="N",
                     help="add a table of accuracy at round N (repeatable)")
    rep.add_argument("--reference", default=None, metavar="METHOD",
                     help="the method the target and factors come from (default: the one "
                          "plain FedAvg method; required where there are several); "
                          "'strongest-fp32': the fp32 method with the highest mean best "
                          "accuracy")
    rep.add_argument("--paired", action="store_true",
                     help="after each bytes-to-target table, the factors seed by seed "
                          "against the reference run of the same seed")
    rep.add_argument("--plot-method", action="append", default=[], metavar="METHOD",
                     help="a method the plots draw (repeatable; default: every method)")
    rep.set_defaults(handler=report)
    pre = commands.add_parser("presets", help="the named presets and their run-config keys")
    pre.set_defaults(handler=presets)
    _add_deploy_parser(commands)
    return parser


def _add_deploy_parser(commands) -> None:
    from fedcomp.ops.deploy import CLIENTAPP_MODES

    dep = commands.add_parser(
        "deploy", help="SuperLink and SuperNodes on several machines (TLS + node auth)")
    actions = dep.add_subparsers(dest="action", required=True)

    def with_certs(p, insecure: bool = True):
        p.add_argument("--certs", default="deploy/certs", help="folder of `deploy certs`")
        if insecure:
            p.add_argument("--insecure", action="store_true",
                           help="no TLS, no node authentication: a test on one machine only")
        return p

    certs = with_certs(actions.add_parser("certs", help="CA, SuperLink certificate, node keys"),
                       insecure=False)
    certs.add_argument("--host", action="append",
                       help="an address the SuperLink is reached at (repeat; default "
                            "localhost and 127.0.0.1)")
    certs.add_argument("--nodes", type=int, default=2, help="node key pairs to make")
    conn = with_certs(actions.add_parser("connection",
                                         help="add a SuperLink connection to FLWR_HOME"))
    conn.add_argument("--name", required=True)
    conn.add_argument("--address", required=True, help="SuperLink host:port")
    link = with_certs(actions.add_parser("superlink", help="start the SuperLink"))
    link.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to serve other machines")
    link.add_argument("--port", type=int, default=8000)
    link.add_argument("--database", default=None,
                      help="state file, so a restarted SuperLink keeps runs and nodes")
    reg = with_certs(actions.add_parser("register", help="register a node's public key"),
                     insecure=False)
    reg.add_argument("--node", type=int, required=True)
    reg.add_argument("--connection", required=True)
    node = with_certs(actions.add_parser("supernode", help="start one SuperNode"))
    node.add_argument("--node", type=int, default=0, help="which node key to use")
    node.add_argument("--superlink", required=True, help="SuperLink host:port")
    node.add_argument("--partition-id", type=int, required=True)
    node.add_argument("--num-partitions", type=int, required=True)
    node.add_argument("--port", type=int, default=9094, help="this node's local API port")
    node.add_argument("--state-dir", default=None,
                      help="where this node keeps residuals and replica between rounds")
    node.add_argument("--data-dir", default=None, help="this node's dataset location")
    node.add_argument("--log-message-size", action="store_true",
                      help="log every message's size (Flower's message_size_mod)")
    node.add_argument("--clientapp", choices=CLIENTAPP_MODES, default="warm",
                      help="warm: one ClientApp process for the whole run (imports and "
                           "data loaded once); per-message: Flower's fresh process per "
                           "message")
    run = actions.add_parser("run", help="run the app on a deployment and check its status")
    run.add_argument("--app", default=".")
    run.add_argument("--connection", required=True)
    run.add_argument("--run-config", default="")
    run.add_argument("--run-name", default="")
    run.add_argument("--results-dir", default="results")
    dep.set_defaults(handler=deploy)


if __name__ == "__main__":
    sys.exit(main())
