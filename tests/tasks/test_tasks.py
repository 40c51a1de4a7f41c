"""Tasks: fedcomp's own and a user's module, checked before round 1."""

from __future__ import annotations

import random
import textwrap
import uuid

import numpy as np
import pytest
import torch

from fedcomp.config import RunConfig
from fedcomp.errors import SpecError
from fedcomp.tasks import BUILTIN, TaskError, check_task, get_task

GOOD = """
import numpy as np
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(),
                                  nn.Linear(16, 3))
    def forward(self, x):
        return self.body(x)

def load_data(data_dir, test_fraction, seed):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((300, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5).astype(np.int64)
    return (x[:240], y[:240]), (x[240:], y[240:])
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Write a task module under a package of its own and make it importable."""
    def write(source: str) -> str:
        name = f"usertask_{uuid.uuid4().hex[:12]}"  # a new module each time
        package = tmp_path / name
        package.mkdir()
        (package / "__init__.py").write_text("")
        (package / "task.py").write_text(textwrap.dedent(source))
        return f"{name}.task"

    monkeypatch.syspath_prepend(str(tmp_path))
    yield write
    get_task.cache_clear()


@pytest.mark.parametrize("name", [n for n in BUILTIN if n != "fashion-mnist"])
def test_builtin_tasks_pass_their_own_check(name):
    task = check_task(name)
    _, test = task.load_data()
    model = task.build_model(0)
    assert set(model.state_dict()) == set(task.build_model(0).state_dict())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  task.build_model(0).state_dict().values(),
                                                  strict=True))
    accuracy, loss = task.evaluate(model, test.x, test.y)
    assert 0 <= accuracy <= 1 and np.isfinite(loss)


def test_mnist1d_is_fixed_data_and_leaves_the_global_generators_alone():
    # The legacy global generators are what the mnist1d package seeds.
    np.random.seed(123)  # noqa: NPY002
    random.seed(123)
    expected_np, expected_py = np.random.random(), random.random()  # noqa: NPY002
    np.random.seed(123)  # noqa: NPY002
    random.seed(123)
    from fedcomp.tasks.mnist1d import load_data

    (x, y), (xt, _) = load_data("", 0.2, 0)
    assert (np.random.random(), random.random()) == (expected_np, expected_py)  # noqa: NPY002
    assert x.shape == (4000, 40) and xt.shape == (1000, 40) and set(np.unique(y)) == set(
        range(10))
    (x2, _), _ = load_data("", 0.2, 7)  # the run seed partitions, it does not regenerate
    np.testing.assert_array_equal(x, x2)


def test_a_user_module_is_a_task(user_module):
    name = user_module(GOOD)
    task = check_task(name)
    train, _ = task.load_data()
    assert len(train) == 240 and task.build_model(3).body[0].weight.shape == (16, 6)
    cfg = RunConfig.from_mapping({"task": name, "local-steps": 3, "local-epochs": 0})
    assert cfg.task_name == name and cfg.resolved_run_name.startswith(name.replace(".", "-"))


@pytest.mark.parametrize(("source", "fragment"), [
    (GOOD.replace("class Net", "class Model"), "lacks Net"),
    (GOOD.replace("def load_data", "def load_arrays"), "lacks load_data"),
    (GOOD.replace("nn.LayerNorm(16)", "nn.BatchNorm1d(16)"), "non-float tensors"),
    (GOOD.replace("astype(np.int64)", "astype(np.float32)", 1), "labels must be int64"),
    (GOOD.replace("nn.Linear(16, 3)", "nn.Linear(16, 2)"), "expected \\(batch, classes >= 3"),
    (GOOD.replace("rng.standard_normal((300, 6)).astype(np.float32)",
                  "rng.standard_normal((300, 6))"), "not float32"),
    ("raise ImportError('no torch here')", "cannot be imported"),
])
def test_a_broken_user_module_is_named_with_what_is_wrong(user_module, source, fragment):
    name = user_module(source)
    with pytest.raises(TaskError, match=fragment) as caught:
        check_task(name)
    assert name.split(".")[0] in str(caught.value)


def test_a_task_name_that_is_neither_builtin_nor_a_module_path_is_refused():
    with pytest.raises(SpecError, match="'task' must be one of"):
        RunConfig(task="cifar10")
    with pytest.raises(TaskError, match="unknown task"):
        get_task("cifar10")
