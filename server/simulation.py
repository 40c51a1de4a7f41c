"""Run a fedcomp simulation in this process with ``flwr.simulation.run_simulation``.

Used by tests, experiments and sweeps: the same ServerApp logic (:func:`run_server`)
and the real ClientApp, with the config passed in directly (``run_simulation`` takes
no run config). Users run simulations through ``flwr run`` (``make run``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

import clients.app as client_module
from fedcomp.config import RunConfig
from fedcomp.ops.cli import FLOWER_ENV
from server.app import run_server

__all__ = ["simulate", "simulate_summary"]


def simulate(cfg: RunConfig, *, num_supernodes: int, client_app: ClientApp | None = None,
             verbose: bool = False, num_cpus: int = 2,
             on_round_end: Callable[[int], None] | None = None,
             ) -> tuple[dict[str, Any], Any]:
    """Run one simulation; return ``(summary, strategy)`` from the server side.

    Exceptions raised by the server side (including ``on_round_end``) propagate.
    """
    for key, value in FLOWER_ENV.items():
        os.environ.setdefault(key, value)
    outcome: dict[str, Any] = {}
    server = ServerApp()

    @server.main()
    def _main(grid: Grid, context: Context) -> None:
        outcome["summary"], outcome["strategy"] = run_server(
            grid, cfg, verbose=verbose, on_round_end=on_round_end)

    logging.getLogger("flwr").setLevel(logging.INFO if verbose else logging.WARNING)
    run_simulation(
        server_app=server, client_app=client_app or client_module.app,
        num_supernodes=num_supernodes,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                        "init_args": {"num_cpus": num_cpus, "logging_level": "ERROR",
                                      "log_to_driver": False}},
    )
    if "summary" not in outcome:
        raise RuntimeError("the ServerApp did not finish")
    return outcome["summary"], outcome["strategy"]


def simulate_summary(cfg: RunConfig, num_supernodes: int, *, verbose: bool = False
                     ) -> dict[str, Any]:
    """One simulation's summary: the runner :func:`fedcomp.ops.sweep.run_sweep` takes."""
    summary, _ = simulate(cfg, num_supernodes=num_supernodes, verbose=verbose)
    return summary
