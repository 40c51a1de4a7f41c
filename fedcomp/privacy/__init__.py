"""Differential privacy for compressed federated learning.

* :mod:`~fedcomp.privacy.clipping`: L2 clipping of a whole update (numpy only).
* :mod:`~fedcomp.privacy.noise`: where the randomness comes from: the OS CSPRNG by
  default, a seeded generator only for non-private reproducible experiments.
* :mod:`~fedcomp.privacy.accounting`: PLD (default) or RDP accounting of
  Poisson-subsampled Gaussian steps, with ``dp-accounting``.
* :mod:`~fedcomp.privacy.central`: client-level DP-FedAvg on the server (Poisson
  client sampling, noise, adaptive clipping with a centred count).
* :mod:`~fedcomp.privacy.subspace`: a random subspace shared by the clients of a
  round, so that noise covers only the coordinates that are sent.
* :mod:`~fedcomp.privacy.dpsgd`: sample-level DP-SGD on a client (imports torch and
  Opacus; import it directly, the package does not).
* :mod:`~fedcomp.privacy.release`: what a DP run may release, and what clients send.
"""

from fedcomp.privacy.accounting import (
    ACCOUNTANTS,
    PrivacyAccountant,
    epsilon_of,
    noise_multiplier_for,
)
from fedcomp.privacy.central import (
    AdaptiveClipping,
    ClientLevelDP,
    SampleLevelBudget,
    adaptive_noise_multiplier,
    poisson_sample,
)
from fedcomp.privacy.clipping import clip_update, update_norm
from fedcomp.privacy.noise import NoiseSource, SecureNoise, SeededNoise, noise_source
from fedcomp.privacy.subspace import RandomSubspace

__all__ = [
    "ACCOUNTANTS",
    "AdaptiveClipping",
    "ClientLevelDP",
    "NoiseSource",
    "PrivacyAccountant",
    "RandomSubspace",
    "SampleLevelBudget",
    "SecureNoise",
    "SeededNoise",
    "adaptive_noise_multiplier",
    "clip_update",
    "epsilon_of",
    "noise_multiplier_for",
    "noise_source",
    "poisson_sample",
    "update_norm",
]
