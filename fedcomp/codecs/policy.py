"""Which pipeline each tensor of a model gets, and encoding a whole update with it.

Small tensors (biases, norm scales) are a rounding error of the bytes but a large
share of the accuracy: TFF's aggregators and PyTorch's PowerSGD hook send them
uncompressed. :class:`CompressionPolicy` does the same: tensors with fewer than
``min_numel`` elements use ``small_codec`` (``none`` by default; ``fp16`` halves them).

One ratio for every large tensor is not what a model needs either. A convolution's
weights are few but applied at every pixel: with Top-0.3% everywhere the 28x28 CNN's
``conv2.weight`` (18,432 weights) sends 55 values a round and its ``fc1.weight``
(401,408) sends 1,204, and the convolution starves (experiments/RESULTS.md,
"What the result rests on"). ``overrides`` give named tensors their own pipeline, chosen by
shell-style patterns on the tensor name, first match wins, like TFF's per-tensor
encoders or DGC's layer-wise ratios.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedcomp.codecs.budget import (
    MAX_ATTEMPTS,
    Allocator,
    Choice,
    TopKFamily,
    next_target,
    value_bits,
    worth_weights,
)
from fedcomp.codecs.feedback import FeedbackMemory, NoFeedback
from fedcomp.codecs.pipeline import Pipeline
from fedcomp.codecs.tensor import to_numpy
from fedcomp.codecs.wire import EncodedTensor, ExpectedTensor, pack_payload
from fedcomp.errors import SpecError

__all__ = [
    "WIRE_HEADERS",
    "BudgetError",
    "CompressionPolicy",
    "EncodedUpdate",
    "encode_update",
    "encode_within_budget",
    "encoder_fingerprint",
    "every_tensor_payload_bytes",
    "minimum_payload_bytes",
    "parse_overrides",
    "smallest_budget_bytes",
]

#: Most per-tensor overrides one policy may hold.
MAX_OVERRIDES = 64


def parse_overrides(text: str) -> tuple[tuple[str, str], ...]:
    """``"conv*.weight=topk:ratio=0.1|quant:bits=4; fc2.*=fp16"`` as (pattern, spec) pairs.

    Entries are separated by ``;``; each is a shell-style pattern on the tensor name,
    ``=``, and a codec spec (which may itself contain ``=``). Whitespace around
    entries is ignored; an empty string means no overrides.

    Raises
    ------
    fedcomp.errors.SpecError
        If an entry has no ``=``, an empty pattern, or a spec that does not parse.
    """
    pairs = []
    for entry in (part.strip() for part in text.split(";")):
        if not entry:
            continue
        pattern, sep, spec = entry.partition("=")
        pattern, spec = pattern.strip(), spec.strip()
        if not sep or not pattern or not spec:
            raise SpecError(f"codec override {entry!r} must be 'PATTERN=SPEC', e.g. "
                            "'conv2.weight=topk:ratio=0.1|quant:bits=4'")
        Pipeline.parse(spec)  # a bad spec is named before the run starts
        pairs.append((pattern, spec))
    if len(pairs) > MAX_OVERRIDES:
        raise SpecError(f"{len(pairs)} codec overrides; at most {MAX_OVERRIDES}")
    return tuple(pairs)


#: How a payload's header may travel (see :class:`CompressionPolicy`).
WIRE_HEADERS = ("json", "predicted")


@dataclass(frozen=True)
class CompressionPolicy:
    """Per-tensor choice of pipeline.

    Parameters
    ----------
    codec
        Spec for tensors with at least ``min_numel`` elements.
    small_codec
        Spec for smaller tensors.
    min_numel
        Size threshold in elements.
    overrides
        ``(pattern, spec)`` pairs: a tensor whose name matches ``pattern``
        (:func:`fnmatch.fnmatchcase`) uses ``spec`` whatever its size; the first
        matching pair wins. See :func:`parse_overrides` for the string form.
    budgeted
        Every tensor without an override gets its Top-K count (and, with
        ``budget_values``, its value coding) from a byte budget every update
        (:func:`encode_within_budget`), whatever its size (unless
        ``budget_small_fixed``). ``codec`` must start with an exact Top-K and its
        count is only the template's.
    budget_values
        The value codings a budget chooses from for each tensor (spec strings, e.g.
        :data:`fedcomp.codecs.budget.VALUE_CHOICES`); empty: ``codec``'s own stages
        after its Top-K.
    budget_worth
        How a budget weighs one tensor's kept energy against another's (one of
        :data:`fedcomp.codecs.budget.WORTH_MEASURES`, see
        :func:`fedcomp.codecs.budget.worth_weights`).
    budget_small_fixed
        Under a budget, tensors under ``min_numel`` elements keep ``small_codec``: each
        is sent whole in every payload, its bytes counted against the budget, and the
        budget allocates what is left to the larger tensors. Biases and norm gains are
        a small share of a model's entries but move every coordinate they touch; a
        model with many of them (a transformer) may learn only when every update
        carries them. Unused without a budget.
    wire_header
        How a payload's header travels (one of :data:`WIRE_HEADERS`): ``"json"``,
        JSON compressed against the layout dictionary (:mod:`fedcomp.codecs.wire`);
        ``"predicted"``, also tries the predicted header (a few bytes a tensor,
        :mod:`fedcomp.codecs.compact_header`) and sends the smaller. A budget spends
        the bytes it saves on values.
    """

    codec: str = "none"
    small_codec: str = "none"
    min_numel: int = 1024
    overrides: tuple[tuple[str, str], ...] = ()
    budgeted: bool = False
    budget_values: tuple[str, ...] = ()
    budget_worth: str = "energy"
    budget_small_fixed: bool = False
    wire_header: str = "json"
    _pipelines: tuple[Pipeline, Pipeline] = field(init=False, repr=False, compare=False)
    _override_pipelines: tuple[tuple[str, Pipeline], ...] = field(
        init=False, repr=False, compare=False)
    _families: dict[int, TopKFamily] = field(default_factory=dict, init=False, repr=False,
                                             compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.min_numel, bool) or not isinstance(self.min_numel, int) \
                or self.min_numel < 0:
            raise SpecError(f"min_numel must be a non-negative integer, got {self.min_numel!r}")
        big = Pipeline.parse(self.codec)
        if self.budgeted and self.budget_values and big.stages:
            # The budget chooses the value coding: the template (which the layout
            # dictionary is built from on both sides) takes the first choice.
            big = Pipeline([big.stages[0], *Pipeline.parse(self.budget_values[0]).stages])
        object.__setattr__(self, "_pipelines", (big, Pipeline.parse(self.small_codec)))
        if len(self.overrides) > MAX_OVERRIDES:
            raise SpecError(f"{len(self.overrides)} codec overrides; at most {MAX_OVERRIDES}")
        override_pipelines = []
        for pair in self.overrides:
            if (not isinstance(pair, tuple) or len(pair) != 2
                    or not all(isinstance(x, str) and x for x in pair)):
                raise SpecError(f"a codec override must be a (pattern, spec) pair of "
                                f"non-empty strings, got {pair!r}")
            override_pipelines.append((pair[0], Pipeline.parse(pair[1])))
        object.__setattr__(self, "_override_pipelines", tuple(override_pipelines))
        if self.budgeted:  # names a codec without a Top-K first, or a bad value coding
            TopKFamily(self._pipelines[0], 1, self.budget_values)
        worth_weights(self.budget_worth, {})  # a bad measure is named before round 1
        if self.wire_header not in WIRE_HEADERS:
            raise SpecError(f"wire header must be one of {', '.join(WIRE_HEADERS)}, got "
                            f"{self.wire_header!r}")

    @property
    def description(self) -> str:
        """One string naming the whole policy (keys saved feedback state)."""
        text = f"{self._pipelines[0].spec} / small<{self.min_numel}: {self._pipelines[1].spec}"
        for pattern, pipeline in self._override_pipelines:
            text += f" / {pattern}: {pipeline.spec}"
        if self.budgeted:
            text += " / budgeted"
            if self.budget_values:
                text += f" ({', '.join(self.budget_values)})"
            if self.budget_worth != "energy":
                text += f" worth {self.budget_worth}"
            if self.budget_small_fixed:
                text += f" small<{self.min_numel} fixed"
        if self.wire_header != "json":  # a budget spends what the header saves
            text += f" / {self.wire_header} header"
        return text

    @property
    def budget_sends_fp32_values(self) -> bool:
        """Whether a budget codes every kept value in 32 bits: budgeted, with no value
        codings to choose from and no value stage after the codec's Top-K (e.g. a
        bare ``"topk"``). Legal, but rarely meant: a 4-bit coding of the same bytes
        keeps about eight times as many entries."""
        return (self.budgeted and not self.budget_values
                and value_bits(self._pipelines[0]) >= 32)

    def family_for(self, shape: Sequence[int], name: str | None = None
                   ) -> TopKFamily | None:
        """The Top-K family a budgeted tensor is sent in, or None (fixed pipeline)."""
        if not self.budgeted:
            return None
        pipeline = self.pipeline_for(shape, name)
        numel = math.prod(shape)
        if pipeline is not self._pipelines[0]:
            return None
        if numel not in self._families:  # keeps the family's pipelines between rounds
            self._families[numel] = TopKFamily(pipeline, numel, self.budget_values)
        return self._families[numel]

    def pipeline_for(self, shape: Sequence[int], name: str | None = None) -> Pipeline:
        """The pipeline a tensor of ``shape`` (named ``name``) uses."""
        if name is not None:
            for pattern, pipeline in self._override_pipelines:
                if fnmatch.fnmatchcase(name, pattern):
                    return pipeline
        big, small = self._pipelines
        if math.prod(shape) >= self.min_numel:
            return big
        return big if self.budgeted and not self.budget_small_fixed else small

    def expected(self, shapes: Mapping[str, Sequence[int]], *,
                 selection: Mapping[str, Sequence[int]] | None = None
                 ) -> dict[str, ExpectedTensor]:
        """What a receiver should demand of a payload for a model of these shapes.

        ``selection`` gives the shapes that choose each tensor's pipeline when they
        differ from the shapes sent (a subspace's 1-D values keep their tensor's codec).
        """
        chooser = selection if selection is not None else shapes
        return {name: ExpectedTensor(tuple(shape), self.pipeline_for(chooser[name], name),
                                     self.family_for(shape, name))
                for name, shape in shapes.items()}


@dataclass
class EncodedUpdate:
    """An encoded model update and what it cost."""

    payload: bytes
    decoded: dict[str, Any]
    encode_s: float
    numel: int

    @property
    def nbytes(self) -> int:
        return len(self.payload)

    @property
    def bits_per_param(self) -> float:
        return 8 * len(self.payload) / max(self.numel, 1)


def encode_update(
    tensors: Mapping[str, Any],
    policy: CompressionPolicy,
    *,
    rng: np.random.Generator,
    feedback: FeedbackMemory | None = None,
    meta: Mapping[str, Any] | None = None,
    layout_dictionary: bool = True,
    selection: Mapping[str, Sequence[int]] | None = None,
    pipelines: Mapping[str, Pipeline | None] | None = None,
) -> EncodedUpdate:
    """Compress every tensor of an update (with error feedback) into one payload.

    The header is compressed against the layout dictionary (names, shapes and
    pipelines the receiver expects; see :mod:`fedcomp.codecs.wire`) unless
    ``layout_dictionary`` is false. ``selection`` gives the shapes that choose each
    tensor's pipeline where they differ from the tensors' own (see
    :meth:`CompressionPolicy.expected`). ``pipelines`` replaces the policy's pipeline
    of the tensors it names by a member of their family (a byte budget's choices), or
    by None: the tensor is left out of the payload and decodes to zeros.

    Returns the payload, the values the receiver will decode (for the caller's own
    bookkeeping, e.g. a downlink replica), and the encode time.
    """
    memory = feedback if feedback is not None else NoFeedback()
    start = time.perf_counter()
    encoded = []
    left_out = []
    decoded: dict[str, Any] = {}
    numel = 0
    shapes: dict[str, tuple[int, ...]] = {}
    for name, value in tensors.items():
        array, _ = to_numpy(value)
        shapes[name] = array.shape
        pipeline = policy.pipeline_for(
            array.shape if selection is None else selection[name], name)
        family = policy.family_for(array.shape, name)
        # The receiver expects a budgeted tensor as its family: the layout dictionary
        # holds the family's representative members too.
        variants = family.dictionary_specs() if family is not None else ()
        layout_spec = ""
        if pipelines is not None and name in pipelines:
            layout_spec, chosen = pipeline.spec, pipelines[name]
            if chosen is None:  # left out this round
                if feedback is not None:
                    raise ValueError(f"tensor {name!r} is left out, which error feedback "
                                     "inside encode_update would not remember; keep the "
                                     "residual as encode_within_budget does")
                decoded[name] = np.zeros(array.shape, dtype=np.float32)
                left_out.append((name, tuple(array.shape), layout_spec, variants))
                numel += array.size
                continue
            pipeline = chosen
        root, decoded[name] = memory.compress(name, value, pipeline, rng)
        encoded.append(EncodedTensor(name, tuple(array.shape), pipeline, root, layout_spec,
                                     variants))
        numel += array.size
    predict_from = None
    if layout_dictionary and policy.wire_header == "predicted":
        predict_from = policy.expected(shapes, selection=selection)
    payload = pack_payload(encoded, meta, use_layout_dictionary=layout_dictionary,
                           left_out=left_out, predict_from=predict_from)
    return EncodedUpdate(payload, decoded, time.perf_counter() - start, numel)


class BudgetError(ValueError):
    """A byte budget below the smallest payload the model can be sent in."""


@dataclass
class BudgetedUpdate(EncodedUpdate):
    """An update encoded within a byte budget, with what it chose for each tensor."""

    choices: dict[str, Choice] = field(default_factory=dict)
    #: The same as (entries sent, estimated bits a kept value) per tensor, as the
    #: receiver reads them from the payload ((0, 0.0) for a tensor left out).
    kept: dict[str, tuple[int, float]] = field(default_factory=dict)


def _encode_choices(tensors: Mapping[str, Any], policy: CompressionPolicy,
                    choices: Mapping[str, Choice], *, rng: np.random.Generator,
                    meta: Mapping[str, Any] | None) -> EncodedUpdate:
    """``tensors`` encoded with each budgeted tensor sent as ``choices[name]`` says
    (left out where its count is 0)."""
    return encode_update(tensors, policy, rng=rng, meta=meta, pipelines={
        name: policy.family_for(tensors[name].shape, name).with_choice(c.count, c.values)
        if c.count else None for name, c in choices.items()})


def encode_within_budget(
    tensors: Mapping[str, Any],
    policy: CompressionPolicy,
    budget: int,
    *,
    rng: np.random.Generator,
    feedback: Any = None,
    meta: Mapping[str, Any] | None = None,
    model: Mapping[str, np.ndarray] | None = None,
) -> BudgetedUpdate:
    """Encode an update into at most ``budget`` payload bytes (see :mod:`fedcomp.codecs.budget`).

    The budgeted tensors' Top-K counts and value codings are allocated from the
    compensated update (delta plus error-feedback residual), the payload is encoded
    and measured, and the estimated total corrected until the payload fits (at most
    :data:`~fedcomp.codecs.budget.MAX_ATTEMPTS` encodes); the largest payload that
    fits is sent and the feedback keeps what it did not carry. A tensor may be left
    out of the payload altogether (count 0), when its bytes are worth more elsewhere.
    ``feedback`` must offer ``compensate`` and ``keep``
    (:class:`~fedcomp.codecs.feedback.ErrorFeedback` or
    :class:`~fedcomp.codecs.feedback.NoFeedback`). ``model``: the tensors the update
    starts from (the receiver's model), which ``budget_worth = "relative"`` weighs
    each tensor's change against.

    Raises
    ------
    BudgetError
        If even the payload that leaves every budgeted tensor out does not fit.
    fedcomp.errors.SpecError
        If the policy's worth measure needs ``model`` and it is not given.
    """
    memory = feedback if feedback is not None else NoFeedback()
    start = time.perf_counter()
    compensated = memory.compensate(tensors)
    families = {name: family for name, value in compensated.items()
                if (family := policy.family_for(value.shape, name)) is not None}
    weights = worth_weights(policy.budget_worth, {name: tensors[name] for name in families},
                            model)
    allocator = Allocator({name: compensated[name] for name in families},
                          {name: family.models for name, family in families.items()},
                          weights, balanced=policy.budget_worth == "balanced")
    best: tuple[EncodedUpdate, dict[str, Choice]] | None = None
    tries: list[tuple[float, int]] = []
    target = 8.0 * budget
    for _ in range(MAX_ATTEMPTS):
        choices = allocator.allocate(target)
        update = _encode_choices(compensated, policy, choices, rng=rng, meta=meta)
        if update.nbytes <= budget and (best is None or update.nbytes > best[0].nbytes):
            best = (update, choices)
        if best is not None and best[0].nbytes >= 0.97 * budget:
            break
        tries.append((allocator.estimated_bits(choices), update.nbytes))
        target = next_target(tries, budget)
    if best is None:
        choices = {name: Choice(0) for name in families}
        update = _encode_choices(compensated, policy, choices, rng=rng, meta=meta)
        if update.nbytes > budget:
            raise BudgetError(f"a byte budget of {budget:,} bytes is below the smallest "
                              f"payload of this model ({update.nbytes:,} bytes)")
        best = (update, choices)
    update, choices = best
    memory.keep({name: compensated[name] - np.asarray(update.decoded[name], dtype=np.float32)
                 for name in compensated})
    kept = {name: (c.count, families[name].models[c.values].bits if c.count else 0.0)
            for name, c in choices.items()}
    return BudgetedUpdate(update.payload, update.decoded, time.perf_counter() - start,
                          update.numel, choices=choices, kept=kept)


def _floor_payload_bytes(policy: CompressionPolicy, shapes: Mapping[str, Sequence[int]],
                         *, every: bool) -> list[int]:
    """Bytes of the smallest payloads of a fixed pseudo-random update (real updates
    may differ by a few bytes): the tensors in fixed pipelines, and one Top-K entry in
    its cheapest value coding of every budgeted tensor (``every``), or of one budgeted
    tensor at a time, the others left out (a size for each)."""
    rng = np.random.default_rng(0)
    update = {name: rng.standard_normal(tuple(shape)).astype(np.float32)
              for name, shape in shapes.items()}
    cheapest = {name: Choice(1, family.cheapest()) for name, shape in shapes.items()
                if (family := policy.family_for(tuple(shape), name)) is not None}
    if not cheapest:
        return [encode_update(update, policy, rng=rng, meta={"round": 0}).nbytes]
    sends = [set(cheapest)] if every else [{name} for name in cheapest]
    return [_encode_choices(update, policy, {
        name: choice if name in sent else Choice(0) for name, choice in cheapest.items()},
        rng=rng, meta={"round": 0}).nbytes for sent in sends]


def minimum_payload_bytes(policy: CompressionPolicy,
                          shapes: Mapping[str, Sequence[int]]) -> int:
    """The smallest useful payload a budgeted policy can send for a model of
    ``shapes``: the tensors in fixed pipelines, and one Top-K entry of the one
    budgeted tensor that costs least in its cheapest value coding, the others left
    out (coded from a fixed pseudo-random update; real updates may differ by a few
    bytes)."""
    return min(_floor_payload_bytes(policy, shapes, every=False))


def every_tensor_payload_bytes(policy: CompressionPolicy,
                               shapes: Mapping[str, Sequence[int]]) -> int:
    """The payload that sends every tensor of a model of ``shapes`` in one budgeted
    policy's payload: one Top-K entry of each budgeted tensor in its cheapest value
    coding, and the tensors in fixed pipelines (coded from the fixed pseudo-random
    update of :func:`minimum_payload_bytes`).

    A budget below it leaves some tensor out of every payload, so those tensors move
    only as often as their error-feedback residuals win a payload's bytes.
    """
    (nbytes,) = _floor_payload_bytes(policy, shapes, every=True)
    return nbytes


def smallest_budget_bytes(policy: CompressionPolicy,
                          shapes: Mapping[str, Sequence[int]]) -> int:
    """The smallest byte budget a run accepts for a model of ``shapes``:
    :func:`minimum_payload_bytes` with a little room (5% and 16 bytes), since real
    updates code a few bytes either way of the reference update's."""
    return int(minimum_payload_bytes(policy, shapes) * 1.05) + 16


def encoder_fingerprint(policies: Sequence[CompressionPolicy],
                        shapes: Mapping[str, Sequence[int]]) -> str:
    """A short hash of the payloads these policies make of a fixed reference update.

    Two runs whose fingerprints agree encoded alike (same bytes for the same update),
    so their byte counts can be compared; a codec, index-coding or wire change that
    alters the bytes changes it even where the run config (and so a sweep's run id)
    is the same. The reference update is a pure function of ``shapes``: seeded
    normal values with one scale per row (1 to 1000), as a layer's update has, so
    that every index coding a real update can pick is exercised. Codecs whose output
    depends on floating-point library details (``lowrank``'s power iteration) may
    fingerprint differently on another BLAS build.
    """
    rng = np.random.default_rng(20261203)
    reference = {}
    for name in sorted(shapes):
        shape = tuple(int(d) for d in shapes[name])
        values = rng.standard_normal(shape).astype(np.float32)
        if len(shape) > 1:
            values *= np.logspace(0, 3, shape[0], dtype=np.float32).reshape(
                (-1,) + (1,) * (len(shape) - 1))
        reference[name] = values
    digest = hashlib.sha256()
    for index, policy in enumerate(policies):
        update = encode_update(reference, policy, rng=np.random.default_rng(index),
                               meta={"round": 1})
        digest.update(hashlib.sha256(update.payload).digest())
    return digest.hexdigest()[:12]
