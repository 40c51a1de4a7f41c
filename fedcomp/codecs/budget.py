"""Compression to a byte budget: each tensor's Top-K count chosen every round.

One Top-K ratio for every tensor is not what a model needs (a convolution's few
weights starve at the ratio that suits a large dense layer), and per-layer ratios
tuned by hand do not carry over to another model. With a budget the user sets one
number, the payload size (``"500x"`` fewer bytes than the fp32 update, ``"0.06bpp"``
bits per parameter, or ``"4kB"``), and the encoder splits it among the tensors every
round from what it is about to send:

* **the choices**: a count ``k`` of entries (Top-K) and a value coding for them,
  from one sign bit per value and one scale (STC's ternary) to 8-bit uniform steps
  (:data:`VALUE_CHOICES`);
* **what each choice is worth**: the energy (sum of squares) its decoded values
  keep of each tensor's compensated update (the delta plus its error-feedback
  residual): that of the ``k`` largest entries less the value coding's error
  (:class:`ValueModel`). A tensor whose residual has grown because it sent little
  before is worth more now; one whose updates stay small against the others' can
  still wait many rounds (a transformer's feed-forward biases, under plain energy).
  With ``budget-worth = "adaptive"`` the uplink divides that energy by the rms of
  each tensor's fresh delta (:func:`worth_weights`), as an adaptive server
  optimizer scales its steps, which lifts such small-scaled tensors; with
  ``"relative"`` by the tensor's squared norm in the model the update starts from,
  so that what counts is each tensor's relative change;
* **what it costs**: ``k`` values at the value coding's bits, its scales, and the
  positions, ``log2 C(n, k)`` bits at the entropy bound that fedcomp's index coding
  is near;
* **the split**: rate-distortion water-filling (:class:`Allocator`). For a price
  ``lam`` every tensor takes the choice that maximises ``energy - lam * bits``;
  ``lam`` is bisected until the estimated total fits, and what is left is handed
  out in steps of best energy per bit.

The estimate is then checked against the real payload:
:func:`fedcomp.codecs.policy.encode_within_budget` encodes, measures the bytes,
corrects the estimated total (:func:`next_target`) and encodes again (at most
:data:`MAX_ATTEMPTS` times), and sends the largest payload that fits. A payload
above the budget is never sent.

A tensor may also be left out of a round (``k = 0``): it is then absent from the
payload and costs no bytes at all, while its update waits in the error-feedback
residual. A tensor that is sent costs a few bytes whatever its ``k`` (its header
entry, the value coding's scale); on a small model with many small tensors (a
transformer's biases and norms) those bytes are most of a tight budget, and
sending every tensor every round would leave nothing for the values.

The receiver cannot know the choices in advance, so a budgeted tensor is expected
as a *family* (:class:`TopKFamily`): the user's Top-K keeping any ``k`` in
``[1, n]``, followed by any of the value codings, or the tensor's absence (a zero
update). The choice travels in the spec string the payload carries anyway (a few
bytes of its compressed header), and the server reads each client's choices from
the payload it decodes: nothing extra is sent to report them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedcomp.codecs.pipeline import Pipeline
from fedcomp.codecs.sparsify import TopK, _count_from
from fedcomp.errors import SpecError

__all__ = ["DENSITY_GRID", "MAX_ATTEMPTS", "VALUE_CHOICES", "WORTH_MEASURES", "Allocator",
           "ByteBudget", "Choice", "TopKFamily", "ValueModel", "candidate_counts",
           "next_target", "parse_budget", "topk_count", "value_bits", "worth_weights"]

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

#: The value codings a budget chooses from for each tensor (``budget-values = "auto"``),
#: from one sign bit and a scale per tensor (STC's ternary) to 8 bits per value: a
#: tensor whose kept values differ widely gains from more bits, one whose values are
#: alike from more entries.
VALUE_CHOICES: tuple[str, ...] = ("ternary:mode=mean", "quant:bits=2", "quant:bits=4",
                                  "quant:bits=8")

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

    The template's Top-K keeping ``k`` entries, ``1 <= k <= numel`` (every other
    Top-K parameter as in the template), followed by one of ``values`` (value codings
    as spec strings, e.g. :data:`VALUE_CHOICES`), or by the template's own stages
    when ``values`` is empty. :meth:`match` is the receiver's check of a spec string
    from an untrusted payload. ``k = 0`` has no pipeline: the tensor is absent from
    the payload (see :func:`fedcomp.codecs.wire.unpack_payload`).

    Raises
    ------
    fedcomp.errors.SpecError
        If the template's first stage is not an exact Top-K.
    """

    def __init__(self, template: Pipeline, numel: int,
                 values: Sequence[str] = ()) -> None:
        first = template.stages[0]
        if not isinstance(first, TopK) or first.approx:
            raise SpecError(f"a byte budget needs a codec that starts with an exact Top-K "
                            f"(e.g. 'topk:ratio=0.01|ternary:mode=mean'), got "
                            f"{template.spec!r}")
        self.template = template
        self.numel = int(numel)
        tails = [tuple(Pipeline.parse(spec).stages) for spec in values] if values else [
            tuple(template.stages[1:])]
        #: The value codings a kept entry may take: stage lists after the Top-K.
        self.tails: tuple[tuple[Any, ...], ...] = tuple(tails)
        #: Their cost and distortion models, in the same order.
        self.models: tuple[ValueModel, ...] = tuple(ValueModel.of(tail) for tail in tails)
        self._configs = [[stage.get_config() for stage in tail] for tail in tails]
        self._first = dataclasses.replace(first, k=0).get_config()
        self._made: dict[tuple[int, int], Pipeline] = {}
        self._dictionary_specs: tuple[str, ...] | None = None

    def with_choice(self, k: int, values: int = 0) -> Pipeline:
        """The template keeping ``k`` entries coded with value coding ``values``."""
        key = (int(k), int(values))
        if key not in self._made:
            self._made[key] = self._member(*key)
        return self._made[key]

    def member_spec(self, k: int, values: int = 0) -> str:
        """The spec of :meth:`with_choice` ``(k, values)``, not kept: a receiver asks
        for whatever count an untrusted payload names."""
        made = self._made.get((k, values))
        return made.spec if made is not None else self._member(k, values).spec

    def _member(self, k: int, values: int) -> Pipeline:
        if not 1 <= k <= self.numel:
            raise ValueError(f"k = {k} is not in [1, {self.numel}]")
        if not 0 <= values < len(self.tails):
            raise ValueError(f"value coding {values} is not in [0, {len(self.tails)})")
        first = dataclasses.replace(self.template.stages[0], k=int(k))
        return Pipeline([first, *self.tails[values]])

    def choice_of(self, spec: str) -> tuple[int, int] | None:
        """``(k, values)`` of the member ``spec`` names, None if it names none."""
        pipeline = self.match(spec)
        if pipeline is None:
            return None
        tail = [stage.get_config() for stage in pipeline.stages[1:]]
        return pipeline.stages[0].k, self._configs.index(tail)

    def match(self, spec: str) -> Pipeline | None:
        """The pipeline ``spec`` names if it belongs to the family, else None."""
        try:
            pipeline = Pipeline.parse(spec)
        except (SpecError, ValueError, TypeError):
            return None
        first = pipeline.stages[0]
        if (not isinstance(first, TopK) or not 1 <= first.k <= self.numel
                or dataclasses.replace(first, k=0).get_config() != self._first
                or [stage.get_config() for stage in pipeline.stages[1:]] not in self._configs):
            return None
        return pipeline

    #: The counts of the members whose headers the layout dictionary holds.
    DICTIONARY_COUNTS = (1, 8, 64, 512)

    def dictionary_specs(self) -> tuple[str, ...]:
        """Representative members (a few counts in every value coding), whose payload
        headers the layout dictionary holds besides the template's
        (:func:`fedcomp.codecs.wire.layout_dictionary`)."""
        if self._dictionary_specs is None:  # asked for at every encode
            self._dictionary_specs = tuple(
                self.with_choice(k, v).spec for k in self.DICTIONARY_COUNTS
                if k <= self.numel for v in range(len(self.tails)))
        return self._dictionary_specs

    def cheapest(self) -> int:
        """The value coding of the smallest payload (one entry)."""
        return int(np.argmin([model.cost_bits(self.numel, np.array([1]))[0]
                              for model in self.models]))


@dataclass(frozen=True)
class ValueModel:
    """What coding ``k`` kept values with one value coding costs and loses (estimates).

    Parameters
    ----------
    kind
        ``"mean"`` (every value becomes ``sign * mean |value|``: ternary after Top-K,
        scaled sign), ``"uniform"`` (b-bit steps between a chunk's min and max) or
        ``"exact"`` (fp32, fp16 and anything unknown: no loss counted).
    bits
        Bits each kept value costs.
    chunk
        Values sharing one set of side information (0: the whole tensor).
    side_bits
        Bits of side information (scales) per chunk.
    levels
        ``2**bits - 1`` steps of a uniform quantizer (0 otherwise).
    stochastic
        Stochastic rounding (a uniform quantizer's error is then larger).
    """

    kind: str
    bits: float
    chunk: int = 0
    side_bits: float = 32.0
    levels: int = 0
    stochastic: bool = True

    @classmethod
    def of(cls, tail: Sequence[Any]) -> ValueModel:
        """The model of the stages after a Top-K (their first value coder counts)."""
        for stage in tail:
            config = stage.get_config()
            kind = config["id"]
            if (kind == "ternary" and config.get("mode") == "mean") or kind in (
                    "sign", "scaledsign"):
                # After Top-K no value is zero: one sign bit each, one scale per chunk.
                return cls("mean", 1.0, int(config.get("chunk", 0) or 0))
            if kind == "quant":
                bits = int(config.get("bits", 8))
                return cls("uniform", float(bits), int(config.get("chunk", 128)), 64.0,
                           (1 << bits) - 1, config.get("rounding", "stochastic") == "stochastic")
            if kind == "ternary":  # stochastic ternary: counted as exact at 1.6 bits
                return cls("exact", 1.6)
            if kind in ("fp16", "bf16"):
                return cls("exact", 16.0, side_bits=0.0)
            if kind == "qsgd":
                return cls("exact", math.log2(2 * float(config.get("levels", 16)) + 1))
        return cls("exact", 32.0, side_bits=0.0)

    def cost_bits(self, numel: int, counts: np.ndarray) -> np.ndarray:
        """Estimated payload bits of a tensor of ``numel`` entries keeping ``counts``:
        values, side information, positions at the entropy bound and a header."""
        chunks = np.ceil(counts / self.chunk) if self.chunk else np.ones(len(counts))
        return (counts * self.bits + chunks * self.side_bits
                + _log2_binomial(numel, counts) + TENSOR_OVERHEAD_BITS)

    def kept_energy(self, ordered: np.ndarray, counts: np.ndarray, *,
                    prefix: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """The energy the decoded values carry: that of the ``counts`` largest
        magnitudes (``ordered``, descending) less the value coding's error.

        ``prefix``: ``(np.cumsum(ordered * ordered), np.cumsum(ordered))`` when the
        caller has them (they are the same for every value coding of a tensor)."""
        cumulative, sums = prefix if prefix is not None else (
            np.cumsum(ordered * ordered), None)
        squares = cumulative[counts - 1]
        if self.kind == "mean":
            # sum a^2 - error, error = sum (a - mean a)^2 = sum a^2 - (sum a)^2 / k
            sums = sums if sums is not None else np.cumsum(ordered)
            return sums[counts - 1] ** 2 / counts
        if self.kind == "uniform":
            # Each chunk's range runs from its most negative to its most positive
            # value: over all chunks those extremes are about the 2 * chunks largest
            # magnitudes, so a step^2 is near 4 * their mean square / levels^2. The
            # extremes are coded exactly, every other value loses about step^2 / 6
            # (stochastic rounding; step^2 / 12 to the nearest).
            chunks = np.ceil(counts / np.minimum(counts, self.chunk)).astype(np.int64)
            extremes = np.minimum(2 * chunks, counts)
            step_sq = 4.0 * cumulative[extremes - 1] / extremes / self.levels ** 2
            inner = np.maximum(counts - 2 * chunks, 0)
            error = inner * step_sq / (6.0 if self.stochastic else 12.0)
            return squares - error
        return squares


def value_bits(pipeline: Pipeline) -> float:
    """Bits one kept value costs under the stages after Top-K (an estimate)."""
    return ValueModel.of(pipeline.stages[1:]).bits


def _log2_binomial(n: int, k: np.ndarray) -> np.ndarray:
    """``log2 C(n, k)`` for an array of ``k`` (the position bits at the entropy bound)."""
    lgamma, ln2 = math.lgamma, math.log(2)
    return np.array([(lgamma(n + 1) - lgamma(int(i) + 1) - lgamma(n - int(i) + 1)) / ln2
                     for i in k], dtype=np.float64)


def candidate_counts(numel: int) -> np.ndarray:
    """The counts a sent tensor of ``numel`` entries may be given (from
    :data:`DENSITY_GRID`, and always 1); leaving it out (0) is a candidate besides."""
    counts = np.clip(np.round(np.array(DENSITY_GRID) * numel), 1, numel)
    return np.unique(np.append(counts, 1)).astype(np.int64)


@dataclass(frozen=True)
class Choice:
    """What one budgeted tensor sends: ``count`` entries in value coding ``values``
    (an index into its family's :attr:`TopKFamily.tails`); ``count = 0``: nothing,
    the tensor is left out of the payload."""

    count: int
    values: int = 0


@dataclass(frozen=True)
class _Hull:
    """A tensor's candidates on their upper concave hull: bits and kept energy both
    increasing, energy per extra bit decreasing."""

    bits: np.ndarray
    energy: np.ndarray
    choices: tuple[Choice, ...]


#: Under ``budget-worth = "balanced"``, the share of a tensor's energy that leaving it
#: out is counted as keeping (its log is the utility of sending nothing): far below
#: what one entry of any real tensor keeps, so a tensor is left out only where the
#: budget cannot hold one entry of every tensor.
BALANCED_FLOOR = 1e-9


def _hull(values: np.ndarray, models: Sequence[ValueModel], *,
          log_share: bool = False) -> _Hull:
    flat = np.abs(np.asarray(values, dtype=np.float32).reshape(-1))
    counts = candidate_counts(flat.size)
    # Sorted in float32 (twice as fast), then widened: the same numbers in the same order.
    ordered = np.sort(flat)[::-1].astype(np.float64)
    bits = np.concatenate([model.cost_bits(flat.size, counts) for model in models])
    prefix = (np.cumsum(ordered * ordered), np.cumsum(ordered))  # shared by the codings
    energy = np.concatenate([model.kept_energy(ordered, counts, prefix=prefix)
                             for model in models])
    choices = [Choice(int(k), index) for index in range(len(models)) for k in counts]
    # Leaving the tensor out: no bytes, nothing kept.
    bits, energy = np.append(0.0, bits), np.append(0.0, energy)
    choices.insert(0, Choice(0))
    if log_share:  # the log of the share of the tensor's energy kept
        total = float(prefix[0][-1]) if flat.size else 0.0
        share = energy / total if total > 0 else np.zeros_like(energy)
        energy = np.log(np.maximum(share, BALANCED_FLOOR))
    keep: list[int] = []
    for i in np.lexsort((-energy, bits)):  # cheapest first, the better of equal costs
        if keep and energy[i] <= energy[keep[-1]]:
            continue  # costs at least as much and keeps no more
        while len(keep) >= 2:
            a, b = keep[-2], keep[-1]
            if (energy[b] - energy[a]) * (bits[i] - bits[b]) \
                    <= (energy[i] - energy[b]) * (bits[b] - bits[a]):
                keep.pop()  # b lies under the chord from a to i
            else:
                break
        keep.append(int(i))
    return _Hull(bits[keep], energy[keep], tuple(choices[i] for i in keep))


def _weighted(hull: _Hull, weight: float) -> _Hull:
    if weight == 1.0:
        return hull
    return dataclasses.replace(hull, energy=hull.energy * weight)


#: The measures of what a tensor's kept energy is worth (``budget-worth``).
WORTH_MEASURES: tuple[str, ...] = ("energy", "adaptive", "relative", "balanced")


def worth_weights(measure: str, fresh: Mapping[str, np.ndarray],
                  model: Mapping[str, np.ndarray] | None = None) -> dict[str, float]:
    """Each budgeted tensor's weight on its kept energy under ``measure``.

    What sending an entry of value ``d`` is worth is, to first order, how much the
    server's step that it causes lowers the loss: the loss's gradient there (about
    ``-d`` over the local learning rate and steps, for a client that ran SGD) times
    that step.

    * ``"energy"``: all 1. A server that applies the mean update as it is (FedAvg,
      server SGD) steps ``d``, so an entry is worth ``d^2``: the energy kept,
      compared across tensors as it is.
    * ``"adaptive"``: ``1 / rms`` of the tensor's *fresh* update (this round's delta,
      without the error-feedback residual), ``sqrt(numel / sum delta^2)``. An
      adaptive server optimizer (FedAdam, FedYogi) divides each coordinate's step by
      its running magnitude, which the fresh delta's rms stands in for, so it steps
      ``d / rms`` and the entry is worth ``d^2 / rms``: a layer whose entries each
      move little (a large dense layer) gains against one whose entries move much
      (biases, a norm's scale), and a residual that has grown while its tensor
      waited still raises that tensor's worth.
    * ``"relative"``: ``1 / (|W|^2 + |delta|^2)``, where ``W`` is the tensor in the
      ``model`` the update starts from and ``delta`` its fresh update: the energy
      kept counted as the squared *relative* change of the tensor, as layer-wise
      trust ratios (LARS, LAMB) measure a step. A layer's output moves with its
      weights' relative change, whatever their scale; energy alone favours the
      tensors whose entries are large (an output layer) over those whose entries are
      small but each shared by many outputs (a convolution's kernels), and it lets
      biases and norms wait. ``|delta|^2`` in the denominator bounds the weight of a
      tensor that is (near) zero, e.g. a bias at initialisation: its whole fresh
      update is then worth about one unit.

    * ``"balanced"``: all 1, and each tensor's worth is the *log* of the share of its
      own energy kept, not the energy (:class:`Allocator` with ``balanced``). The
      budget then maximises the product of the tensors' kept shares: an entry is
      worth its energy over what its tensor already keeps, so every tensor is sent
      (leaving one out counts as keeping :data:`BALANCED_FLOOR` of it) and a tensor
      whose update is small against the others' still keeps a like share of it, as
      a fixed Top-K ratio per tensor does. Weights would only add a constant to a
      tensor's log, so none is applied.

    Dividing by the mean square instead (every entry worth the same in its own
    tensor's units) is not offered: it ignores that the loss falls by the gradient
    times the step, so it starves small tensors (norms, biases) whose entries each
    cost a header's bytes.

    A tensor whose weight would divide by zero (no fresh update, and for
    ``"relative"`` a zero tensor too) keeps weight 1.

    Raises
    ------
    SpecError
        If ``measure`` is not one of :data:`WORTH_MEASURES`, or ``"relative"`` is
        asked for without the ``model`` of every tensor in ``fresh``.
    """
    if measure not in WORTH_MEASURES:
        raise SpecError(f"budget worth must be one of {', '.join(WORTH_MEASURES)}, "
                        f"got {measure!r}")
    weights = {name: 1.0 for name in fresh}
    if measure in ("energy", "balanced"):
        return weights
    if measure == "relative" and fresh and (
            model is None or (missing := sorted(set(fresh) - set(model)))):
        raise SpecError("budget worth 'relative' needs the model the update starts from"
                        + ("" if model is None else f"; it lacks {', '.join(missing)}"))
    for name, value in fresh.items():
        flat = np.asarray(value, dtype=np.float64).reshape(-1)
        energy = float(np.dot(flat, flat))
        if measure == "adaptive":
            if energy > 0:
                weights[name] = (flat.size / energy) ** 0.5
            continue
        start = np.asarray(model[name], dtype=np.float64).reshape(-1)
        scale = float(np.dot(start, start)) + energy
        if scale > 0:
            weights[name] = 1.0 / scale
    return weights


class Allocator:
    """Rate-distortion water-filling of one update's budgeted tensors.

    Each tensor's candidates are every count of :func:`candidate_counts` in every
    value coding its family offers, worth the energy their decoded values keep
    (:meth:`ValueModel.kept_energy`) at the bits :meth:`ValueModel.cost_bits`
    estimates; only those on the upper concave hull of (bits, energy) can be best at
    some price. Built once per update (it sorts each tensor's magnitudes), then
    :meth:`allocate` is cheap and can be called for several totals.

    Parameters
    ----------
    tensors
        The compensated update (delta plus error-feedback residual) of each budgeted
        tensor.
    models
        Each tensor's value codings' models (its family's :attr:`TopKFamily.models`).
    weights
        What a unit of each tensor's energy is worth against the others' (1 for a
        tensor not named; see :func:`worth_weights`). Scaling a tensor's energies
        leaves its own hull as it is and moves only the exchange rate between tensors.
    balanced
        Count each candidate's worth as the log of the share of its tensor's energy
        it keeps (``budget-worth = "balanced"``; ``weights`` are then ignored): the
        allocation maximises the product of the kept shares.
    """

    def __init__(self, tensors: Mapping[str, np.ndarray],
                 models: Mapping[str, Sequence[ValueModel]],
                 weights: Mapping[str, float] | None = None, *,
                 balanced: bool = False) -> None:
        weights = {} if balanced else (weights or {})
        self.hulls = {name: _weighted(_hull(value, models[name], log_share=balanced),
                                      weights.get(name, 1.0))
                      for name, value in tensors.items()}
        self._models = {name: tuple(models[name]) for name in tensors}
        self._numel = {name: int(np.size(value)) for name, value in tensors.items()}
        # All hulls back to back (for :meth:`at_price`): names, bits, energy, where
        # each hull starts, and which hull each point belongs to.
        names = list(self.hulls)
        lengths = np.array([len(self.hulls[name].bits) for name in names], dtype=np.int64)
        self._names = names
        self._bits = np.concatenate([self.hulls[name].bits for name in names] or [[]])
        self._energy = np.concatenate([self.hulls[name].energy for name in names] or [[]])
        self._starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
        self._owner = np.repeat(np.arange(len(names)), lengths)

    def at_price(self, lam: float) -> dict[str, int]:
        """Each tensor's hull index that maximises ``energy - lam * bits`` (the first
        such point where several tie, as ``np.argmax`` of each hull picks).

        All hulls are laid back to back once, so a price costs a few array operations
        rather than one ``argmax`` per tensor: :meth:`allocate` bisects 60 prices."""
        if not self._names:
            return {}
        worth = self._energy - lam * self._bits
        peak = np.maximum.reduceat(worth, self._starts)[self._owner]
        at_peak = np.flatnonzero(worth == peak)
        first = at_peak[np.concatenate(([True], np.diff(self._owner[at_peak]) != 0))]
        return dict(zip(self._names, (first - self._starts).tolist(), strict=True))

    def choice_bits(self, name: str, choice: Choice) -> float:
        """The estimated bits of one tensor's choice (0 when it is left out)."""
        if choice.count == 0:
            return 0.0
        return float(self._models[name][choice.values].cost_bits(
            self._numel[name], np.array([choice.count]))[0])

    def estimated_bits(self, choices: Mapping[str, Choice]) -> float:
        """The estimated bits of ``choices`` (as :meth:`allocate` returned them)."""
        return float(sum(self.choice_bits(name, choice) for name, choice in choices.items()))

    def allocate(self, budget_bits: float) -> dict[str, Choice]:
        """Each tensor's choice, the estimated bits of all together within
        ``budget_bits`` (every tensor left out when nothing fits).

        For a price ``lam`` every tensor takes the hull point maximising
        ``energy - lam * bits``; ``lam`` is bisected (on a log scale) to the cheapest
        price whose total fits, then the bits left over go, one hull step at a time,
        to the step with the most energy per extra bit that still fits. Pure: the
        same update and total give the same choices.
        """
        hulls = self.hulls
        if not hulls:
            return {}

        def total(choice: Mapping[str, int]) -> float:
            # Added one by one in tensor order, as the choices are compared to the
            # budget: the same float whatever the number of tensors.
            return float(sum(hulls[name].bits[i] for name, i in choice.items()))

        # The widest span of worth (from leaving a tensor out, the hull's first point)
        # sets the range of prices per bit worth bisecting.
        scale = max(float(h.energy[-1] - h.energy[0]) for h in hulls.values())
        best = {name: 0 for name in hulls}
        if scale > 0:
            lo, hi = math.log(scale) - 80.0, math.log(scale) + 10.0  # price per bit
            if total(self.at_price(math.exp(lo))) <= budget_bits:
                best = self.at_price(math.exp(lo))
            else:
                for _ in range(60):
                    mid = 0.5 * (lo + hi)
                    choice = self.at_price(math.exp(mid))
                    if total(choice) <= budget_bits:
                        hi, best = mid, choice
                    else:
                        lo = mid
            spent = total(best)
            while True:  # spend what the discrete choice left
                step, gain = None, 0.0
                for name, i in best.items():
                    h = hulls[name]
                    if i + 1 < len(h.bits):
                        extra = h.bits[i + 1] - h.bits[i]
                        if spent + extra <= budget_bits:
                            value = (h.energy[i + 1] - h.energy[i]) / extra
                            if step is None or value > gain:
                                step, gain = name, value
                if step is None:
                    break
                spent += hulls[step].bits[best[step] + 1] - hulls[step].bits[best[step]]
                best[step] += 1
        choices = {name: hulls[name].choices[i] for name, i in best.items()}
        left = budget_bits - sum(hulls[name].bits[i] for name, i in best.items())
        if (topped := self._top_up(best, left)) is not None:
            choices[topped[0]] = topped[1]
        return choices

    def _top_up(self, best: Mapping[str, int], left: float) -> tuple[str, Choice] | None:
        """Spend what is left between grid points: the sent tensor whose next hull
        step (in the same value coding) gains most per bit takes as many more entries
        as fit, its cost being near linear in ``k`` between neighbouring counts. The
        grid alone leaves up to a fifth of a large tensor's share unspent, and the
        payload's fit to the budget then hunts between two grid points. ``best``: each
        tensor's hull index; returns the tensor topped up and its new choice (None:
        none can be)."""
        step, gain = None, 0.0
        for name, i in best.items():
            h = self.hulls[name]
            if h.choices[i].count == 0 or i + 1 == len(h.bits) \
                    or h.choices[i + 1].values != h.choices[i].values:
                continue
            slope = (h.energy[i + 1] - h.energy[i]) / (h.bits[i + 1] - h.bits[i])
            if step is None or slope > gain:
                step, gain = name, slope
        if step is None or left <= 0:
            return None
        h, i = self.hulls[step], best[step]
        values, base = h.choices[i].values, h.bits[i]
        lo, hi = h.choices[i].count, h.choices[i + 1].count - 1  # the most that fits
        while lo < hi:  # the cost rises with k: bisect the largest count within ``left``
            mid = (lo + hi + 1) // 2
            if self.choice_bits(step, Choice(mid, values)) - base <= left:
                lo = mid
            else:
                hi = mid - 1
        return step, Choice(lo, values)


def next_target(tries: Sequence[tuple[float, int]], budget: int) -> float:
    """The next estimated total (bits) to allocate, after ``tries`` of (estimated
    bits of the choice made, measured payload bytes), aiming just under ``budget``
    bytes.

    One try: the measured miss is added to the estimate (headers and side
    information, which do not scale with the choice, are what the estimate misses
    most). Once tries lie on both sides of the aim: the chord between the closest
    on each side (regula falsi), which cannot leave the bracket. Otherwise the secant
    through the last two tries, when they rise together, or the miss again.
    """
    aim = 0.985 * budget
    below = [t for t in tries if t[1] <= aim]
    above = [t for t in tries if t[1] > aim]
    if below and above:
        (t0, s0), (t1, s1) = max(below, key=lambda t: t[1]), min(above, key=lambda t: t[1])
        if t1 > t0 and s1 > s0:
            return t0 + (aim - s0) * (t1 - t0) / (s1 - s0)
    target, size = tries[-1]
    if len(tries) >= 2:
        (t0, s0), (t1, s1) = tries[-2], tries[-1]
        if t1 != t0 and 0 < (s1 - s0) / (t1 - t0) < 1.0:
            return max(t1 + (aim - s1) * (t1 - t0) / (s1 - s0), 1.0)
    return max(target + 8.0 * (aim - size), 1.0)
