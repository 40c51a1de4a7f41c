"""Sample-level DP: DP-SGD on one client's data, with secret noise and secret batches.

Opacus supplies the per-example gradients (``GradSampleModule``) and the clipping
(``DPOptimizer``); fedcomp supplies the randomness. Opacus' own secure mode needs
``torchcsprng``, which is not maintained for current torch, and its default noise and
Poisson sampling come from torch generators that a caller seeds (or torch's default
generator, whose seed is a constant). Here both the noise and the Poisson batch
membership come from a :class:`~fedcomp.privacy.noise.NoiseSource`: the OS CSPRNG
unless the run asked for reproducible (non-private) noise.

With a shared random subspace (:mod:`fedcomp.privacy.subspace`) each example's
gradient is masked to the subspace before it is clipped, and the noise goes on the
subspace only: all of the clipping norm is spent there, and the update stays in it.

Importing this module imports torch and Opacus; nothing else in
:mod:`fedcomp.privacy` does.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np
import torch
from opacus.grad_sample import GradSampleModule
from opacus.optimizers import DPOptimizer

from fedcomp.privacy.accounting import PrivacyAccountant, dp_sgd_plan
from fedcomp.privacy.noise import NoiseSource

__all__ = ["PrivacyBudgetExhausted", "strip_module_prefix", "train_dp_sgd"]


class PrivacyBudgetExhausted(RuntimeError):
    """Raised by a client whose next round of DP-SGD would exceed ``dp-target-epsilon``."""


def strip_module_prefix(state: Mapping[str, object]) -> dict[str, object]:
    """State-dict keys without the ``_module.`` prefix Opacus' wrapper adds."""
    return {k.removeprefix("_module."): v for k, v in state.items()}


class _SourcedNoiseOptimizer(DPOptimizer):
    """Opacus' DPOptimizer with the noise drawn from a NoiseSource (and masked)."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, noise: NoiseSource,
                 masks: dict[int, torch.Tensor], **kwargs: object) -> None:
        super().__init__(optimizer, **kwargs)
        self._noise = noise
        self._masks = masks

    def add_noise(self) -> None:
        std = self.noise_multiplier * self.max_grad_norm
        for p in self.params:
            summed = p.summed_grad
            drawn = torch.from_numpy(self._noise.normal(std, tuple(summed.shape))).to(summed.dtype)
            mask = self._masks.get(id(p))
            if mask is not None:
                drawn = drawn * mask
            p.grad = (summed + drawn).view_as(p)


def train_dp_sgd(
    model: torch.nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    epochs: int,
    steps: int,
    batch_size: int,
    lr: float,
    momentum: float,
    noise_multiplier: float,
    max_grad_norm: float,
    accountant: PrivacyAccountant,
    delta: float,
    noise: NoiseSource,
    target_epsilon: float = 0.0,
    masks: Mapping[str, np.ndarray] | None = None,
) -> tuple[float, int]:
    """DP-SGD on one client's data; the steps are added to ``accountant``.

    One accountant serves the client's whole life (kept in its state between rounds),
    so its epsilon is cumulative over every round the client has trained. Each step
    draws a Poisson batch (every example with probability ``q``), clips each example's
    gradient (masked to ``masks`` where given) to ``max_grad_norm``, adds Gaussian
    noise of std ``noise_multiplier * max_grad_norm`` to the sum (on the masks only)
    and divides by the expected batch size ``q n``. An empty batch still takes a
    noisy step, as the analysis assumes.

    Returns
    -------
    (sampling rate, steps taken)

    Raises
    ------
    PrivacyBudgetExhausted
        If ``target_epsilon`` > 0 and this round would take epsilon past it; the
        model is left untouched.
    """
    rate, planned = dp_sgd_plan(len(y), batch_size=batch_size, epochs=epochs, steps=steps)
    if target_epsilon > 0:
        after = accountant.epsilon_after(noise_multiplier, rate, planned, delta)
        if after > target_epsilon:
            raise PrivacyBudgetExhausted(
                f"this round of DP-SGD would take epsilon to {after:.3f}, above "
                f"dp-target-epsilon {target_epsilon}: not training")
    wrapped = GradSampleModule(model, loss_reduction="sum")
    by_param = {id(p): torch.from_numpy(np.ascontiguousarray(masks[name])).to(p.dtype)
                for name, p in model.named_parameters() if masks is not None and name in masks}
    optimizer = _SourcedNoiseOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum), noise=noise,
        masks=by_param, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
        expected_batch_size=max(1, round(rate * len(y))), loss_reduction="mean")
    features, labels = torch.from_numpy(x), torch.from_numpy(y)
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
    wrapped.train()
    for _ in range(planned):
        chosen = np.flatnonzero(noise.uniform(len(y)) < rate)
        index = torch.from_numpy(chosen)
        optimizer.zero_grad()
        loss = loss_fn(wrapped(features[index]), labels[index])
        with warnings.catch_warnings():  # Opacus' hooks on an input without grad
            warnings.filterwarnings("ignore", message="Full backward hook")
            loss.backward()
        for p in model.parameters():
            mask = by_param.get(id(p))
            if mask is not None and p.grad_sample is not None:
                p.grad_sample.mul_(mask)  # broadcast over the batch dimension
        optimizer.step()
    optimizer.zero_grad()
    wrapped.to_standard_module()  # drop Opacus' hooks and per-example buffers
    accountant.step(noise_multiplier, rate, planned)
    return rate, planned
