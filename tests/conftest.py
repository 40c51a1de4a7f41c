"""Shared test configuration: Flower's environment, hypothesis profiles, fixtures."""

from __future__ import annotations

import os

# Flower phones home and installs dependencies at run time unless told not to
# (telemetry, update checks). Set before anything imports flwr; fedcomp.ops.cli keeps the
# one list of these variables and imports no Flower itself.
from fedcomp.ops.cli import FLOWER_ENV

for _key, _value in FLOWER_ENV.items():
    os.environ.setdefault(_key, _value)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "default", deadline=None, max_examples=60,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "ci", deadline=None, max_examples=60, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough", deadline=None, max_examples=1000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE",
                                     "ci" if os.environ.get("CI") else "default"))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(12345)


#: The model of the strategy tests: one weight matrix and its bias.
STRATEGY_SHAPES = {"w": (30, 40), "b": (30,)}


@pytest.fixture
def make_strategy(monkeypatch):
    """A CompressedFedAvg on a small random model, in a process posing as a ServerApp."""
    # Messages read the run id of the current process, which a ServerApp would set.
    from flwr.supercore.task_identity import TaskIdentity
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 0)

    def make(**settings):
        from fedcomp.config import RunConfig
        from strategies.compressed import CompressedFedAvg

        # The shared (full-model) downlink unless a test asks for another: replies
        # then report the digest of the strategy's model.
        settings.setdefault("downlink_codec", "none")
        rng = np.random.default_rng(0)
        initial = {k: rng.standard_normal(s).astype(np.float32)
                   for k, s in STRATEGY_SHAPES.items()}
        return CompressedFedAvg(RunConfig(codec="topk:ratio=0.1", min_numel=10, **settings),
                                initial)
    return make
