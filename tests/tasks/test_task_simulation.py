"""Tasks end to end in Flower's simulation engine (slow)."""

from __future__ import annotations

import os
import textwrap

import pytest

from fedcomp.config import RunConfig
from fedcomp.tasks import get_task
from tests.tasks.test_tasks import GOOD

pytestmark = pytest.mark.slow


def _simulate(cfg, nodes=3):
    from server.simulation import simulate

    return simulate(cfg, num_supernodes=nodes)


def test_the_sequence_task_trains_with_compression(tmp_path):
    cfg = RunConfig(dataset="mnist1d", num_server_rounds=3, local_epochs=1,
                    codec="topk:ratio=0.05|quant:bits=4", results_dir=str(tmp_path),
                    run_name="mnist1d")
    summary, strategy = _simulate(cfg)
    assert summary["rounds_completed"] == 3
    assert summary["final_accuracy"] > summary["initial_accuracy"] + 0.05  # it learns
    assert any("self_attn" in name for name in strategy.broadcaster.model)
    assert summary["uplink_compression"] > 5


def test_a_user_task_module_runs_and_a_broken_one_stops_before_round_one(tmp_path,
                                                                         monkeypatch):
    package = tmp_path / "mytasks"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "good.py").write_text(textwrap.dedent(GOOD))
    (package / "bad.py").write_text(textwrap.dedent(GOOD).replace("class Net", "class Model"))
    # Flower's simulation workers are other processes: they find the module the way a
    # deployed app's would, on their import path.
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    try:
        cfg = RunConfig(task="mytasks.good", num_server_rounds=2, local_epochs=2,
                        codec="topk:ratio=0.1|quant:bits=8", min_numel=64,
                        results_dir=str(tmp_path), run_name="good")
        summary, _ = _simulate(cfg)
        assert summary["rounds_completed"] == 2 and summary["uplink_bytes"] > 0
        with pytest.raises(Exception, match=r"'mytasks.bad' lacks Net"):
            _simulate(cfg.replace(task="mytasks.bad", run_name="bad"))
        assert not (tmp_path / "bad" / "rounds.csv").exists()
    finally:
        get_task.cache_clear()
