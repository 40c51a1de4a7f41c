"""The command line's own logic (Flower's commands are exercised in the deploy tests)."""

from __future__ import annotations

import pytest

from fedcomp.ops.cli import _TableFilter
from fedcomp.ops.results import format_summary_table

SUMMARY = {"run_name": "run-1", "config": {"codec": "topk:ratio=0.01|quant:bits=4"},
           "rounds_completed": 20, "final_accuracy": 0.97, "best_accuracy": 0.975,
           "uplink_bytes": 899_000, "downlink_bytes": 115_011_000,
           "fp32_uplink_bytes": 121_000_000, "uplink_compression": 134.6,
           "model_bytes_fp32": 1_000}


def _shown(lines: list[str]) -> tuple[list[str], list[str]]:
    table = _TableFilter()
    shown = [out for line in lines for out in table.feed(line)]
    return shown, table.held


def test_the_server_apps_table_is_held_back_and_the_rest_of_the_log_shown():
    table = format_summary_table([SUMMARY]).splitlines()
    log = ["INFO: round 20", "", *table, "results: /tmp/run-1",
           "DEBUG: ServerApp finished running."]
    shown, held = _shown(log)
    assert shown == ["INFO: round 20", "", "DEBUG: ServerApp finished running."]
    assert held == [*table, "results: /tmp/run-1"]


def test_a_block_that_is_not_the_table_is_let_through():
    # A header-like line not followed by the ServerApp's results line within the
    # limit is ordinary log: every line of it is shown, in order.
    header = format_summary_table([SUMMARY]).splitlines()[0]
    log = ["a", header, *(f"line {i}" for i in range(_TableFilter.MAX_HELD + 5))]
    shown, held = _shown(log)
    assert shown == log and held == []
    # Lines that merely mention the words are never held.
    assert _shown(["INFO: run codec rounds final acc best acc"])[0] == [
        "INFO: run codec rounds final acc best acc"]


def test_the_quiet_log_shows_round_lines_warnings_and_errors_only():
    from fedcomp.ops.cli import _QuietLog

    info, warning = "\x1b[92mINFO \x1b[0m:", "\x1b[93mWARNING \x1b[0m:"
    error = "\x1b[91mERROR \x1b[0m:"
    log = [
        "Using SuperLink: local (127.0.0.1:39091)",
        f"{info}      Starting Flower Simulation",
        f"{warning}   Since flwr 1.32, default simulated SuperNodes changed from 10 to 2.",
        f"{warning}   fraction_evaluate is set to 0.0. Federated evaluation will be skipped.",
        "fedcomp: digits, 20 rounds, uplink 'topk:ratio=0.01|quant:bits=4'",
        f"{info}      [ROUND 1/20]",
        f"{info}      \t└──> Aggregated MetricRecord: {{'clients-ok': 10}}",
        "[round   1/20] acc 0.1003 loss 2.2581 | up 43.2 kB (x140 vs fp32)",
        f"{warning}   Client 3 timed out",
        f"{error}     ServerApp raised an exception",
        "Traceback (most recent call last):",
        '  File "server/app.py", line 1, in main',
        f"{info}      ",
    ]
    quiet = _QuietLog(keep=3)
    shown = [line for entry in log for line in quiet.feed(entry)]
    assert shown == [log[4], log[7], log[8], log[9], log[10], log[11]]
    # What was held back last is kept for a run that fails.
    assert list(quiet.recent) == [log[5], log[6], log[12]]


def test_flower_gets_whole_cpus_per_client(monkeypatch, tmp_path):
    """Flower 1.42 refuses ``client-resources-num-cpus=1.0`` ('float' object cannot be
    interpreted as an integer): the runner and the command line pass whole numbers."""
    import pytest

    from fedcomp.config import RunConfig
    from fedcomp.ops import cli

    seen = []

    def fake_run(project, connection, run_config, *, federation, where, verbose):
        seen.append(federation)
        return "1", "finished:failed", [], []

    monkeypatch.setattr(cli, "_flower_run", fake_run)
    runner = cli.flower_runner(tmp_path)
    with pytest.raises(RuntimeError, match="finished:failed"):
        runner(RunConfig(results_dir=str(tmp_path), run_name="x"), 3)
    assert seen == ["num-supernodes=3 client-resources-num-cpus=1"]
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["simulate", "--cpus-per-client", "0.5"])


def _fake_process(proc, pid: int, argv: list[str], cwd: str, fds: list[str]) -> None:
    entry = proc / str(pid)
    (entry / "fd").mkdir(parents=True)
    (entry / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (entry / "cwd").symlink_to(cwd)
    for number, target in enumerate(fds):
        (entry / "fd" / str(number)).symlink_to(target)


def test_local_superlinks_whose_checkout_was_deleted_are_found_and_only_those(tmp_path):
    from fedcomp.ops.cli import stale_local_superlinks

    proc, home = tmp_path / "proc", tmp_path / "home"
    (home / "local-superlink").mkdir(parents=True)
    database = home / "local-superlink" / "state.db"
    database.write_bytes(b"")
    gone = str(tmp_path / "gone" / "state.db")

    def superlink(db: str, *extra: str) -> list[str]:
        return ["/venv/bin/python", "/venv/bin/flower-superlink", "--insecure", *extra,
                "--port", "39091", "--database", db]

    _fake_process(proc, 101, superlink(str(database), "--simulation"), str(tmp_path),
                  [str(database)])  # alive and well
    _fake_process(proc, 102, superlink(gone, "--simulation"), str(tmp_path), [])
    _fake_process(proc, 103, superlink(str(database), "--simulation"), str(tmp_path),
                  [f"{database} (deleted)"])  # a new file at the old path
    _fake_process(proc, 104, superlink(str(database), "--simulation"),
                  f"{tmp_path}/old (deleted)", [str(database)])
    _fake_process(proc, 105, superlink(gone), str(tmp_path), [])  # a deployment's: not ours
    _fake_process(proc, 106, ["/usr/bin/sleep", "--simulation", "--database", gone],
                  str(tmp_path), [])
    (proc / "self").mkdir()
    assert stale_local_superlinks(proc) == [102, 103, 104]


def test_a_local_superlink_of_another_environment_is_found_and_refused(tmp_path):
    from fedcomp.ops.cli import foreign_local_superlinks, refuse_foreign_local_superlink

    proc = tmp_path / "proc"
    ours, theirs = tmp_path / "here" / ".venv" / "bin", tmp_path / "there" / ".venv" / "bin"
    ours.mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "here")  # the same checkout by another path

    def superlink(folder: str, *extra: str) -> list[str]:
        return [f"{folder}/python", f"{folder}/flower-superlink", "--insecure", *extra,
                "--port", "39091", "--database", str(tmp_path / "state.db")]

    _fake_process(proc, 201, superlink(str(ours), "--simulation"), str(tmp_path), [])
    _fake_process(proc, 202, superlink(str(tmp_path / "link" / ".venv" / "bin"),
                                       "--simulation"), str(tmp_path), [])
    _fake_process(proc, 203, ["python", "flower-superlink", "--simulation"], str(tmp_path), [])
    _fake_process(proc, 204, superlink(str(theirs)), str(tmp_path), [])  # a deployment's
    (proc / "self").mkdir()
    assert foreign_local_superlinks(ours, proc) == []
    refuse_foreign_local_superlink(ours, proc)  # nothing to refuse: returns

    _fake_process(proc, 205, superlink(str(theirs), "--simulation"), str(tmp_path), [])
    assert foreign_local_superlinks(ours, proc) == [(205, str(theirs))]
    with pytest.raises(SystemExit) as raised:
        refuse_foreign_local_superlink(ours, proc)
    message = str(raised.value)
    assert "pid 205" in message and str(theirs) in message and "kill 205" in message


def test_a_stale_local_superlink_is_stopped(tmp_path, capsys):
    import subprocess
    import sys

    from fedcomp.ops.cli import stop_stale_local_superlinks

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        proc = tmp_path / "proc"
        _fake_process(proc, child.pid, ["python", "flower-superlink", "--simulation",
                                        "--database", str(tmp_path / "gone.db")],
                      str(tmp_path), [])
        assert stop_stale_local_superlinks(proc, wait_s=0.2) == [child.pid]
        assert child.wait(timeout=10) != 0  # ended by a signal
        assert f"pid {child.pid}" in capsys.readouterr().out
    finally:
        child.kill()


def _fake_flwr(tmp_path):
    """A stand-in for the ``flwr`` tool that records its arguments."""
    calls = tmp_path / "calls.txt"
    tool = tmp_path / "flwr"
    tool.write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho {{}}\n')
    tool.chmod(0o755)
    return str(tool), calls


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_an_interrupted_command_stops_the_flower_run_it_waits_on(tmp_path, how):
    """The Flower run does not belong to the command that started it: interrupted
    (Ctrl-C, or SIGTERM as a job runner sends), the command stops the run with
    ``flwr stop`` before it exits, so the run does not go on writing its folder."""
    import os
    import signal

    from fedcomp.ops.cli import _stops_run_when_interrupted

    tool, calls = _fake_flwr(tmp_path)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), \
            _stops_run_when_interrupted(tool, "1234", "local", dict(os.environ)):
        if how == "ctrl-c":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pause()  # the handler raises before this returns
    assert calls.read_text().split() == ["stop", "1234", "local", "--format", "json"]
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back


def test_a_run_that_ends_by_itself_is_not_stopped(tmp_path):
    import os
    import signal

    from fedcomp.ops.cli import _stops_run_when_interrupted

    tool, calls = _fake_flwr(tmp_path)
    before = signal.getsignal(signal.SIGTERM)
    with _stops_run_when_interrupted(tool, "1234", "local", dict(os.environ)):
        pass
    assert not calls.exists()
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_interrupted_command_exits_130_without_a_traceback(monkeypatch, capsys):
    from fedcomp.ops import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "presets", interrupted)  # the parser binds it when built
    assert cli.main(["presets"]) == 130
    assert "interrupted" in capsys.readouterr().err
