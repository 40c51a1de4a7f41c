"""Compression to a byte budget: each tensor's Top-K count chosen every round.

One Top-K ratio for every tensor is not what a model needs (a convolution's few
weights starve at the ratio that suits a large dense layer), and per-layer ratios
tuned by hand do not carry over to another model. With a budget the user sets one
number, the payload size (``"500x"`` fewer bytes than the fp32 update, ``"0.06bpp"``
bits per parameter, or ``"4kB"``), and the encoder splits it among the tensors every
round from what it is about to send:

* **what each choice is worth**: the energy (sum of squares) of the ``k`` largest
  entries of each tensor's compensated update (the delta plus its error-feedback
  residual). A tensor whose residual has grown because it sent little before is
  worth more now, so no tensor starves for good;
* **what it costs**: ``k`` values at the value codec's bits plus the positions,
  ``log2 C(n, k)`` bits at the entropy bound that fedcomp's index coding is near;
* **the split**: rate-distortion water-filling. For a price ``lam`` every tensor
  takes the count that maximises ``energy - lam * bits``; ``lam`` is bisected until
  the estimated total fits, and what is left is handed out in steps of best energy
  per bit (:func:`allocate_counts`).

The estimate is then checked against the real payload: :func:`encode_within_budget`
encodes, measures the bytes, rescales and encodes again (at most
:data:`MAX_ATTEMPTS` times) and sends the largest payload that fits. A payload above
the budget is never sent.

The receiver cannot know the counts in advance, so a budgeted tensor is expected as
a *family* (:class:`TopKFamily`): the user's pipeline with its Top-K keeping any
``k`` in ``[1, n]``, every other parameter fixed. The count travels in the spec
string the payload carries anyway (a few bytes of its compressed header), and the
server reads each client's choices from the payload it decodes: nothing extra is
sent to report them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fedcomp.codecs.pipeline import Pipeline
from fedcomp.codecs.sparsify import TopK, _count_from
from fedcomp.errors import SpecError

__all__ = ["DENSITY_GRID", "MAX_ATTEMPTS", "ByteBudget", "TopKFamily", "allocate_counts",
           "candidate_counts", "estimated_bits", "parse_budget", "topk_count",
           "value_bits"]

#: Densities a tensor may be given (k = density * n, at least 1): quarter-octave steps
#: from all entries down to 2^-16. Fine enough that rounding to the grid costs little,
#: coarse enough that the allocation takes a millisecond.
DENSITY_GRID: tuple[float, ...] = tuple(2.0 ** (-j / 4) for j in range(0, 65))

#: Encodes per update at most while fitting the payload to the budget.
MAX_ATTEMPTS = 6

#: Bits a tensor's entry in the payload costs besides its values and positions (its
#: spec index and tree in the header, the value codec's scale): a rough constant, the
#: measured payload corrects it.
TENSOR_OVERHEAD_BITS = 64

_BUDGET = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(x|bpp|B|kB|KiB)\s*$")


@dataclass(frozen=True)
class ByteBudget:
    """A payload budget as the user wrote it.

    Parameters
    ----------
    text
        ``"500x"`` (the fp32 update's bytes divided by 500), ``"0.064bpp"`` (bits per
        parameter of the update), ``"4000B"``, ``"4kB"`` (1000 bytes) or ``"4KiB"``.
    """

    text: str
    value: float
    unit: str

    def payload_bytes(self, numel: int) -> int:
        """The most bytes one update of ``numel`` parameters may take."""
        if self.unit == "x":
            return int(4 * numel / self.value)
        if self.unit == "bpp":
            return int(self.value * numel / 8)
        scale = {"B": 1, "kB": 1000, "KiB": 1024}[self.unit]
        return int(self.value * scale)

    def describe(self, numel: int) -> str:
        nbytes = self.payload_bytes(numel)
        return (f"{self.text!r} = {nbytes:,} bytes for {numel:,} parameters "
                f"({4 * numel / max(nbytes, 1):.0f}x fewer than fp32, "
                f"{8 * nbytes / max(numel, 1):.4f} bits a parameter)")


def parse_budget(text: str) -> ByteBudget | None:
    """A budget string as a :class:`ByteBudget`; ``""`` means no budget (None).

    Raises
    ------
    fedcomp.errors.SpecError
        For anything but a positive number and one of the units ``x``, ``bpp``,
        ``B``, ``kB``, ``KiB`` (a factor must be at least 1).
    """
    if not isinstance(text, str):
        raise SpecError(f"a byte budget must be a string such as '500x', got {text!r}")
    if not text.strip():
        return None
    match = _BUDGET.match(text)
    value = float(match.group(1)) if match else math.nan
    if match is None or not math.isfinite(value) or value <= 0:
        raise SpecError(f"byte budget {text!r} must be a positive number with a unit: "
                        "'500x' (fewer bytes than fp32), '0.064bpp' (bits a parameter), "
                        "'4000B', '4kB' or '4KiB'")
    unit = match.group(2)
    if unit == "x" and value < 1:
        raise SpecError(f"byte budget {text!r}: a factor below 1x is more than fp32")
    return ByteBudget(text.strip(), value, unit)


def topk_count(pipeline: Pipeline, numel: int) -> int | None:
    """How many entries a pipeline whose first stage is Top-K keeps of ``numel``."""
    first = pipeline.stages[0]
    if not isinstance(first, TopK):
        return None
    return _count_from(first.ratio, first.k, numel)


class TopKFamily:
    """Every pipeline a budgeted tensor of ``numel`` entries may arrive in.

    The template with its Top-K keeping ``k`` entries, ``1 <= k <= numel``; every
    other parameter of every stage as in the template. :meth:`match` is the
    receiver's check of a spec string from an untrusted payload.

    Raises
    ------
    fedcomp.errors.SpecError
        If the template's first stage is not an exact Top-K.
    """

    def __init__(self, template: Pipeline, numel: int) -> None:
        first = template.stages[0]
        if not isinstance(first, TopK) or first.approx:
            raise SpecError(f"a byte budget needs a codec that starts with an exact Top-K "
                            f"(e.g. 'topk:ratio=0.01|ternary:mode=mean'), got "
                            f"{template.spec!r}")
        self.template = template
        self.numel = int(numel)
        self._rest = [stage.get_config() for stage in template.stages[1:]]
        self._first = dataclasses.replace(first, k=0).get_config()
        self._made: dict[int, Pipeline] = {}

    def with_count(self, k: int) -> Pipeline:
        """The template keeping ``k`` entries."""
        if not 1 <= k <= self.numel:
            raise ValueError(f"k = {k} is not in [1, {self.numel}]")
        if k not in self._made:
            first = dataclasses.replace(self.template.stages[0], k=int(k))
            self._made[k] = Pipeline([first, *self.template.stages[1:]])
        return self._made[k]

    def match(self, spec: str) -> Pipeline | None:
        """The pipeline ``spec`` names if it belongs to the family, else None."""
        try:
            pipeline = Pipeline.parse(spec)
        except (SpecError, ValueError, TypeError):
            return None
        first = pipeline.stages[0]
        if (not isinstance(first, TopK) or len(pipeline.stages) != len(self.template.stages)
                or not 1 <= first.k <= self.numel
                or dataclasses.replace(first, k=0).get_config() != self._first
                or [stage.get_config() for stage in pipeline.stages[1:]] != self._rest):
            return None
        return pipeline


def value_bits(template: Pipeline) -> float:
    """Bits one kept value costs under the stages after Top-K (an estimate).

    Known value codecs by their width; anything else counts as 32 bits. Only the
    ratio of value bits to position bits steers the split; the measured payload
    corrects the total.
    """
    bits = 32.0
    for stage in template.stages[1:]:
        config = stage.get_config()
        kind = config["id"]
        if kind == "ternary":
            bits = math.log2(3)
        elif kind in ("sign", "scaledsign"):
            bits = 1.0
        elif kind == "quant":
            bits = float(config.get("bits", 8))
        elif kind in ("fp16", "bf16"):
            bits = 16.0
        elif kind == "qsgd":
            bits = math.log2(2 * float(config.get("levels", 16)) + 1)
    return bits


def _log2_binomial(n: int, k: np.ndarray) -> np.ndarray:
    """``log2 C(n, k)`` for an array of ``k`` (the position bits at the entropy bound)."""
    lgamma, ln2 = math.lgamma, math.log(2)
    return np.array([(lgamma(n + 1) - lgamma(int(i) + 1) - lgamma(n - int(i) + 1)) / ln2
                     for i in k], dtype=np.float64)


def candidate_counts(numel: int) -> np.ndarray:
    """The counts a tensor of ``numel`` entries may be given (from :data:`DENSITY_GRID`,
    and always 1: the floor :func:`fedcomp.codecs.policy.minimum_payload_bytes` assumes)."""
    counts = np.clip(np.round(np.array(DENSITY_GRID) * numel), 1, numel)
    return np.unique(np.append(counts, 1)).astype(np.int64)


def estimated_bits(numel: int, counts: np.ndarray, bits_per_value: float) -> np.ndarray:
    """Estimated payload bits of a tensor for each of ``counts``."""
    return (counts * bits_per_value + _log2_binomial(numel, counts)
            + TENSOR_OVERHEAD_BITS)


@dataclass(frozen=True)
class _Curve:
    counts: np.ndarray
    energy: np.ndarray
    bits: np.ndarray


def _curve(values: np.ndarray, bits_per_value: float) -> _Curve:
    flat = np.abs(np.asarray(values, dtype=np.float32).reshape(-1)).astype(np.float64)
    counts = candidate_counts(flat.size)
    ordered = np.sort(flat)[::-1]
    energy = np.cumsum(ordered * ordered)[counts - 1]
    return _Curve(counts, energy, estimated_bits(flat.size, counts, bits_per_value))


def allocate_counts(tensors: Mapping[str, np.ndarray], bits_per_value: float,
                    budget_bits: float) -> dict[str, int]:
    """Top-K counts for ``tensors`` whose estimated payload bits fit ``budget_bits``.

    Water-filling on the candidate counts of :func:`candidate_counts`: for a price
    ``lam`` each tensor takes the count maximising ``energy(k) - lam * bits(k)``;
    ``lam`` is bisected (on a log scale) to the cheapest price whose total fits,
    then the bits left over go, one candidate step at a time, to the step with the
    most energy per extra bit that still fits. Every tensor keeps at least one entry,
    so the result may exceed a budget below that floor.

    Pure: the same tensors and budget give the same counts.
    """
    curves = {name: _curve(value, bits_per_value) for name, value in tensors.items()}
    if not curves:
        return {}

    def choose(lam: float) -> dict[str, int]:
        return {name: int(np.argmax(c.energy - lam * c.bits)) for name, c in curves.items()}

    def total(choice: Mapping[str, int]) -> float:
        return float(sum(curves[name].bits[i] for name, i in choice.items()))

    scale = max(float(c.energy[-1]) for c in curves.values())
    if scale <= 0:  # nothing to send: the fewest entries everywhere
        return {name: int(c.counts[0]) for name, c in curves.items()}
    lo, hi = math.log(scale) - 80.0, math.log(scale) + 10.0  # price per bit, log scale
    best = {name: 0 for name in curves}
    if total(choose(math.exp(lo))) <= budget_bits:
        best = choose(math.exp(lo))
    else:
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            choice = choose(math.exp(mid))
            if total(choice) <= budget_bits:
                hi, best = mid, choice
            else:
                lo = mid
    # Spend what the discrete choice left: the best energy per extra bit that fits.
    spent = total(best)
    while True:
        step, gain = None, 0.0
        for name, i in best.items():
            c = curves[name]
            if i + 1 < len(c.counts):
                extra = c.bits[i + 1] - c.bits[i]
                if spent + extra <= budget_bits and extra > 0:
                    value = (c.energy[i + 1] - c.energy[i]) / extra
                    if step is None or value > gain:
                        step, gain = name, value
        if step is None:
            break
        spent += curves[step].bits[best[step] + 1] - curves[step].bits[best[step]]
        best[step] += 1
    return {name: int(curves[name].counts[i]) for name, i in best.items()}


def fit_scale(scale: float, size: int, budget: int) -> float:
    """The next scale of the estimated budget to try after ``scale`` made ``size``
    bytes: assumes bytes roughly proportional to the scale and aims just under the
    budget."""
    return scale * 0.985 * budget / max(size, 1)
