"""Learning tasks: the model, the data, local training and evaluation, by name.

A task is a Python module. fedcomp's own are ``digits``, ``fashion-mnist`` and
``mnist1d`` (:data:`BUILTIN`); any other is named by its import path, e.g.
``task = "mypackage.task"`` in the run config. The module follows the names of
Flower's PyTorch quickstart ``task.py``:

``Net``
    a ``torch.nn.Module`` class built with no arguments. fedcomp seeds torch around
    the call, so every client builds the same round-0 model. Its ``state_dict`` must
    hold float tensors only (they are what fedcomp compresses): use GroupNorm or
    ``track_running_stats=False`` rather than BatchNorm's integer counter.
``load_data(data_dir: str, test_fraction: float, seed: int)``
    the whole training set and the server's test set, as
    ``((x_train, y_train), (x_test, y_test))`` numpy arrays (features float32, labels
    int64 class indices). It must need no network. fedcomp partitions the training
    set among clients itself, with flwr-datasets' partitioners by label (the run
    config's ``partitioning``), so that every task gets IID, Dirichlet and
    pathological splits alike.
``train(net, x, y, *, epochs, steps, batch_size, lr, momentum, proximal_mu, seed)`` (optional)
    local training; returns the mean loss. Default: :func:`fedcomp.tasks.training.train`
    (SGD with momentum on cross-entropy).
``test(net, x, y)`` (optional)
    ``(accuracy, loss)``. Default: :func:`fedcomp.tasks.training.evaluate`.

Adding a dataset or a model is one such file. :func:`check_task` runs before round 1
and stops a run whose task is missing something, with a message naming the module and
what is wrong.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from fedcomp.errors import SpecError

__all__ = ["BUILTIN", "Task", "TaskError", "check_task", "get_task"]

#: fedcomp's own tasks by name.
BUILTIN = {
    "digits": "fedcomp.tasks.digits",
    "fashion-mnist": "fedcomp.tasks.fashion_mnist",
    "mnist1d": "fedcomp.tasks.mnist1d",
}


class TaskError(SpecError):
    """A task module lacks something fedcomp needs, or gives something unusable."""


@dataclass(frozen=True)
class Task:
    """A loaded task module, with fedcomp's defaults where it provides nothing."""

    name: str
    module: ModuleType

    def build_model(self, seed: int) -> Any:
        """``Net()`` built from torch's RNG seeded with ``seed`` (the global RNG is left
        as it was)."""
        import torch

        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return self.module.Net()

    def load_data(self, data_dir: str = "", test_fraction: float = 0.2, seed: int = 0):
        """(train, test) as :class:`fedcomp.tasks.data.ArrayDataset`, cached per process."""
        return _load_data(self.name, data_dir, test_fraction, seed)

    @property
    def train(self) -> Callable[..., float]:
        from fedcomp.tasks.training import train

        return getattr(self.module, "train", train)

    @property
    def evaluate(self) -> Callable[..., tuple[float, float]]:
        from fedcomp.tasks.training import evaluate

        return getattr(self.module, "test", evaluate)


def _import(name: str) -> ModuleType:
    path = BUILTIN.get(name, name)
    if name not in BUILTIN and "." not in name:
        raise TaskError(f"unknown task {name!r}: fedcomp's own are {', '.join(BUILTIN)}; "
                        "any other is a module's import path, e.g. 'mypackage.task'")
    try:
        return importlib.import_module(path)
    except ImportError as exc:
        raise TaskError(f"task module {path!r} cannot be imported: {exc}") from None


@functools.lru_cache(maxsize=16)
def get_task(name: str) -> Task:
    """The task called ``name`` (a built-in name or a module path), its API checked."""
    module = _import(name)
    missing = [attr for attr in ("Net", "load_data") if not callable(getattr(module, attr,
                                                                             None))]
    missing += [attr for attr in ("train", "test")
                if hasattr(module, attr) and not callable(getattr(module, attr))]
    if missing:
        raise TaskError(f"task module {module.__name__!r} lacks {', '.join(missing)} (or "
                        f"has them but not callable): see fedcomp.tasks for what a task "
                        "provides")
    return Task(name, module)


@functools.lru_cache(maxsize=8)
def _load_data(name: str, data_dir: str, test_fraction: float, seed: int):
    from fedcomp.tasks.data import ArrayDataset

    task = get_task(name)
    try:
        (x, y), (x_test, y_test) = task.module.load_data(data_dir, test_fraction, seed)
    except (TypeError, ValueError) as exc:
        raise TaskError(f"task module {task.module.__name__!r}: load_data(data_dir, "
                        f"test_fraction, seed) must return ((x_train, y_train), (x_test, "
                        f"y_test)): {exc}") from None
    splits = []
    for what, features, labels in (("train", x, y), ("test", x_test, y_test)):
        features, labels = np.asarray(features), np.asarray(labels)
        if features.dtype != np.float32:
            raise TaskError(f"task module {task.module.__name__!r}: {what} features are "
                            f"{features.dtype}, not float32")
        if labels.dtype != np.int64 or labels.ndim != 1 or len(labels) != len(features):
            raise TaskError(f"task module {task.module.__name__!r}: {what} labels must be "
                            f"int64 of shape ({len(features)},), got {labels.dtype} "
                            f"{labels.shape}")
        if len(labels) == 0:
            raise TaskError(f"task module {task.module.__name__!r}: the {what} set is empty")
        splits.append(ArrayDataset(features, labels))
    return splits[0], splits[1]


def check_task(name: str, data_dir: str = "", test_fraction: float = 0.2,
               seed: int = 0) -> Task:
    """Load a task and try it once: float tensors only, outputs that match the labels.

    Raises
    ------
    TaskError
        Naming the module and what is wrong.
    """
    import torch

    task = get_task(name)
    where = f"task module {task.module.__name__!r}"
    model = task.build_model(seed)
    if not isinstance(model, torch.nn.Module):
        raise TaskError(f"{where}: Net() must build a torch.nn.Module, got "
                        f"{type(model).__name__}")
    state = model.state_dict()
    if not state:
        raise TaskError(f"{where}: Net() has no parameters")
    not_float = [k for k, v in state.items() if not torch.is_floating_point(v)]
    if not_float:
        raise TaskError(f"{where}: the model's state holds non-float tensors "
                        f"{', '.join(not_float[:4])}; fedcomp compresses float tensors "
                        "(use GroupNorm or BatchNorm with track_running_stats=False)")
    train, test = task.load_data(data_dir, test_fraction, seed)
    with torch.no_grad():
        out = model(torch.from_numpy(test.x[:4]))
    classes = int(max(train.y.max(), test.y.max())) + 1
    if out.ndim != 2 or out.shape[0] != min(4, len(test.y)) or out.shape[1] < classes:
        raise TaskError(f"{where}: Net() maps a batch of {min(4, len(test.y))} to "
                        f"{tuple(out.shape)}; expected (batch, classes >= {classes})")
    return task
