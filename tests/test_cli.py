"""The command line's own logic (Flower's commands are exercised in the deploy tests)."""

from __future__ import annotations

from fedcomp.cli import _TableFilter
from fedcomp.results import format_summary_table

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
