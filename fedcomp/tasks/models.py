"""The model of a task by name (the models themselves live in :mod:`fedcomp.tasks`)."""

from __future__ import annotations

from typing import Any

__all__ = ["build_model", "model_shapes"]


def build_model(task: str, *, seed: int) -> Any:
    """The ``Net`` of ``task`` (a built-in name or a module path), seeded with ``seed``."""
    from fedcomp.tasks import get_task

    return get_task(task).build_model(seed)


def model_shapes(task: str) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of ``task``'s model."""
    return {k: tuple(v.shape) for k, v in build_model(task, seed=0).state_dict().items()}
