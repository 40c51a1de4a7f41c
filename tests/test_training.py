"""Local training helpers: what the in-process experiments play for each client."""

from __future__ import annotations

import numpy as np
import torch

from fedcomp.tasks.data import load_dataset
from fedcomp.tasks.models import build_model
from fedcomp.tasks.training import state_arrays, train_from


def test_train_from_starts_at_the_given_state_and_leaves_it_untouched():
    data, _ = load_dataset("digits")
    model = build_model("digits", seed=0)
    start = state_arrays(model)
    kept = {k: v.copy() for k, v in start.items()}
    model.load_state_dict({k: torch.from_numpy(v * 0) for k, v in start.items()})
    first = train_from(model, start, data.x[:64], data.y[:64], epochs=1, seed=5)
    again = train_from(model, start, data.x[:64], data.y[:64], epochs=1, seed=5)
    for name in start:
        np.testing.assert_array_equal(start[name], kept[name])
        np.testing.assert_array_equal(first[name], again[name])  # a pure function of start
    assert any(not np.array_equal(first[k], start[k]) for k in start)  # it trained
