"""Local training and evaluation loops (plain PyTorch, no Flower)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

__all__ = ["evaluate", "flat_delta", "load_arrays", "state_arrays", "train"]


def state_arrays(model: nn.Module) -> dict[str, np.ndarray]:
    """Copies of the model's parameters and buffers as float32 numpy arrays."""
    return {k: v.detach().cpu().numpy().astype(np.float32, copy=True)
            for k, v in model.state_dict().items()}


def load_arrays(model: nn.Module, arrays: dict[str, np.ndarray]) -> None:
    """Load numpy ``arrays`` (as :func:`state_arrays` gives them) into ``model``; the
    model gets copies, so it cannot alias or change them."""
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in arrays.items()})


def flat_delta(after: dict[str, np.ndarray], before: dict[str, np.ndarray]) -> np.ndarray:
    """All tensors' differences concatenated into one float32 vector."""
    return np.concatenate([(after[k] - before[k]).reshape(-1) for k in before])


def train(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    epochs: int = 1,
    steps: int = 0,
    batch_size: int = 32,
    lr: float = 0.05,
    momentum: float = 0.9,
    proximal_mu: float = 0.0,
    seed: int = 0,
) -> float:
    """SGD with momentum for ``epochs`` epochs (or exactly ``steps`` steps if > 0).

    With ``proximal_mu > 0`` the loss gains FedProx's term
    ``mu / 2 * ||w - w_start||^2``, which keeps heterogeneous clients near the global
    model. Returns the mean training loss over the steps taken. Batches are shuffled
    by a generator seeded with ``seed``.
    """
    if len(y) == 0:
        return float("nan")
    generator = np.random.default_rng(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    loss_fn = nn.CrossEntropyLoss()
    anchor = [p.detach().clone() for p in model.parameters()] if proximal_mu > 0 else None
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    model.train()
    total, taken = 0.0, 0
    target_steps = steps if steps > 0 else epochs * -(-len(y) // batch_size)
    while taken < target_steps:
        order = torch.from_numpy(generator.permutation(len(y)))
        for start in range(0, len(y), batch_size):
            batch = order[start:start + batch_size]
            optimizer.zero_grad()
            loss = loss_fn(model(xt[batch]), yt[batch])
            if anchor is not None:
                loss = loss + 0.5 * proximal_mu * sum(
                    ((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor,
                                                         strict=True))
            loss.backward()
            optimizer.step()
            total += loss.item()
            taken += 1
            if taken >= target_steps:
                break
    return total / taken


@torch.no_grad()
def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray,
             batch_size: int = 512) -> tuple[float, float]:
    """(accuracy, mean cross-entropy loss) on the given data."""
    model.eval()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    correct, loss = 0, 0.0
    for start in range(0, len(y), batch_size):
        xb = torch.from_numpy(x[start:start + batch_size])
        yb = torch.from_numpy(y[start:start + batch_size])
        logits = model(xb)
        loss += float(loss_fn(logits, yb))
        correct += int((logits.argmax(1) == yb).sum())
    return correct / max(len(y), 1), loss / max(len(y), 1)


def train_from(model: nn.Module, start: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray,
               *, epochs: int, seed: int, lr: float = 0.05, momentum: float = 0.9
               ) -> dict[str, np.ndarray]:
    """Load ``start`` into ``model``, train it (:func:`train`) and return its state.

    One client's local round as the in-process experiments play it.
    """
    load_arrays(model, start)
    train(model, x, y, epochs=epochs, lr=lr, momentum=momentum, seed=seed)
    return state_arrays(model)
