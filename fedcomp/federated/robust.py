"""Byzantine-robust aggregation rules over decoded (compressed) client updates.

The same rules Flower offers for dense weights (``FedMedian``, ``FedTrimmedAvg``,
``Krum``), applied to the deltas the server decoded from compressed payloads, so that
they combine with any codec. Each takes the round's decoded updates, in the order the
server sums them, and returns one update; none of them weighs by the example counts
clients claim (a claim is exactly what an attacker can inflate).

* ``median``: the coordinate-wise median (Yin et al., 2018).
* ``trimmed:beta=B``: per coordinate, drop the ``floor(B n)`` largest and smallest
  values and average the rest (Yin et al., 2018).
* ``krum:f=F,m=M``: the ``M`` updates whose summed squared distance to their
  ``n - F - 2`` nearest neighbours is smallest, averaged (Blanchard et al., 2017;
  ``M = 1`` is Krum, ``M > 1`` multi-Krum). Needs ``n > 2F + 2`` updates; with fewer
  it falls back to the coordinate-wise median.

A rule is written as a spec string, as codecs are: ``"mean"`` (the weighted mean, the
default), ``"median"``, ``"trimmed:beta=0.1"``, ``"krum:f=1,m=3"``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fedcomp.codecs.spec import parse_spec
from fedcomp.errors import SpecError

__all__ = ["AggregationRule", "parse_rule"]

Update = Mapping[str, np.ndarray]

_PARAMS = {"mean": {}, "median": {}, "trimmed": {"beta": 0.1}, "krum": {"f": 1, "m": 1}}


@dataclass(frozen=True)
class AggregationRule:
    """One parsed rule; :meth:`combine` applies it."""

    name: str = "mean"
    beta: float = 0.1
    f: int = 1
    m: int = 1

    @property
    def robust(self) -> bool:
        """Whether it needs every update at once (all but the weighted mean)."""
        return self.name != "mean"

    def combine(self, updates: Sequence[Update]) -> dict[str, np.ndarray]:
        """The rule's aggregate of ``updates`` (float64; at least one update)."""
        if not updates:
            raise ValueError("nothing to aggregate")
        names = list(updates[0])
        if self.name == "median" or (self.name == "krum" and len(updates) <= 2 * self.f + 2):
            return {k: np.median(np.stack([u[k] for u in updates]), axis=0) for k in names}
        if self.name == "trimmed":
            cut = math.floor(self.beta * len(updates))
            out = {}
            for k in names:
                stacked = np.sort(np.stack([u[k] for u in updates]).astype(np.float64), axis=0)
                out[k] = stacked[cut:len(updates) - cut].mean(axis=0)
            return out
        if self.name == "krum":
            return self._krum(updates, names)
        raise ValueError(f"combine() is for robust rules, not {self.name!r}")

    def _krum(self, updates: Sequence[Update], names: list[str]) -> dict[str, np.ndarray]:
        flat = np.stack([np.concatenate([np.asarray(u[k], np.float64).ravel() for k in names])
                         for u in updates])
        squares = (flat ** 2).sum(axis=1)
        distances = np.maximum(squares[:, None] + squares[None, :] - 2 * flat @ flat.T, 0.0)
        nearest = len(updates) - self.f - 2
        scores = np.sort(distances, axis=1)[:, 1:nearest + 1].sum(axis=1)  # skip itself
        chosen = np.argsort(scores, kind="stable")[:min(self.m, len(updates))]
        return {k: np.mean([np.asarray(updates[i][k], np.float64) for i in chosen], axis=0)
                for k in names}


def parse_rule(spec: str) -> AggregationRule:
    """``"mean"``, ``"median"``, ``"trimmed:beta=0.1"`` or ``"krum:f=1,m=3"``."""
    configs = parse_spec(spec)
    if len(configs) != 1:
        raise SpecError(f"an aggregation rule is one stage, got {spec!r}")
    params = dict(configs[0])
    name = params.pop("id")
    if name not in _PARAMS:
        raise SpecError(f"unknown aggregation rule {name!r}; choose one of "
                        f"{', '.join(_PARAMS)}")
    unknown = sorted(set(params) - set(_PARAMS[name]))
    if unknown:
        raise SpecError(f"aggregation rule {name!r} has no parameter {unknown[0]!r}")
    values = {**_PARAMS[name], **params}
    if name == "trimmed" and not (isinstance(values["beta"], (int, float))
                                  and 0 <= values["beta"] < 0.5):
        raise SpecError(f"trimmed: beta must be in [0, 0.5), got {values['beta']!r}")
    if name == "krum" and not all(isinstance(values[k], int) and not isinstance(values[k], bool)
                                  and values[k] >= lo for k, lo in (("f", 0), ("m", 1))):
        raise SpecError(f"krum: f must be an integer >= 0 and m >= 1, got {values}")
    return AggregationRule(name, **values)
