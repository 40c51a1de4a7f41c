"""The example Flower app turns on fedcomp with a mod and a wrapper (slow: a simulation)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "quickstart-compressed"


@pytest.fixture
def example(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    # The simulation's workers are other processes: they import the app the same way.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(EXAMPLE), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.chdir(tmp_path)
    yield
    for name in [m for m in sys.modules if m.startswith("quickstart_compressed")]:
        del sys.modules[name]


@pytest.mark.slow
def test_the_example_app_sends_compressed_updates_and_learns(example, tmp_path):
    from flwr.simulation import run_simulation
    from quickstart_compressed.client_app import app as client_app
    from quickstart_compressed.server_app import app as server_app

    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=3,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 2, "logging_level": "ERROR",
                                                 "log_to_driver": False}})
    results = json.loads((tmp_path / "results" / "quickstart-compressed.json").read_text())
    rounds = results["rounds"]
    assert len(rounds) == 5
    up = sum(r["uplink_bytes"] for r in rounds.values())
    fp32 = sum(r["fp32_uplink_bytes"] for r in rounds.values())
    from quickstart_compressed.task import Net

    params = sum(p.numel() for p in Net().state_dict().values())
    assert fp32 == 5 * 3 * 4 * params  # every update decoded, the model's fp32 size each
    # Payload bytes actually received: Top-1% of a 17k-parameter model keeps ~170 values,
    # so the per-tensor headers weigh as much as the values; still over 10x below fp32.
    assert fp32 / up > 10
    accuracies = [rounds[r]["accuracy"] for r in sorted(rounds, key=int)]
    assert accuracies[-1] > 0.5 and accuracies[-1] > accuracies[0]


def test_the_mod_and_the_wrapper_are_a_few_lines_of_the_app():
    """What a user adds to an ordinary Flower app (the README shows the diff)."""
    added = [line for path in ("client_app.py", "server_app.py")
             for line in (EXAMPLE / "quickstart_compressed" / path).read_text().splitlines()
             if "fedcomp" in line]
    assert 2 <= len(added) <= 10
    pyproject = (EXAMPLE / "pyproject.toml").read_text()
    assert "[tool.flwr.app.components]" in pyproject and '"fedcomp"' in pyproject
