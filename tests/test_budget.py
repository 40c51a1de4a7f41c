"""Compression to a byte budget: parsing, the Top-K family the receiver admits, the
water-filling allocation, and encoding that never exceeds the budget."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcomp.codecs.budget import (
    VALUE_CHOICES,
    Allocator,
    Choice,
    TopKFamily,
    ValueModel,
    next_target,
    parse_budget,
    topk_count,
    value_bits,
    worth_weights,
)
from fedcomp.codecs.feedback import ErrorFeedback, NoFeedback
from fedcomp.codecs.pipeline import Pipeline
from fedcomp.codecs.policy import (
    BudgetError,
    CompressionPolicy,
    _encode_choices,
    encode_update,
    encode_within_budget,
    minimum_payload_bytes,
)
from fedcomp.codecs.wire import EncodedTensor, pack_payload, unpack_payload
from fedcomp.config import RunConfig
from fedcomp.errors import PayloadError, SpecError
from fedcomp.federated.aggregation import ClientReply, aggregate_deltas
from fedcomp.ops.results import RoundRecord, record_densities, record_downlink_densities

SHAPES = {"conv1.weight": (32, 1, 3, 3), "conv1.bias": (32,), "conv2.weight": (64, 32, 3, 3),
          "fc1.weight": (128, 784), "fc2.weight": (10, 128)}
NUMEL = sum(math.prod(s) for s in SHAPES.values())
TEMPLATE = "topk:ratio=0.01|ternary:mode=mean"
POLICY = CompressionPolicy(TEMPLATE, "quant:bits=8", 1024, budgeted=True)
AUTO = CompressionPolicy(TEMPLATE, "quant:bits=8", 1024, budgeted=True,
                         budget_values=VALUE_CHOICES)
TERNARY = ValueModel.of(Pipeline.parse(TEMPLATE).stages[1:])
MODELS = [ValueModel.of(Pipeline.parse(spec).stages) for spec in VALUE_CHOICES]


def _update(seed: int, scales: dict[str, float] | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: (rng.standard_normal(shape) * (scales or {}).get(name, 1.0)).astype(
        np.float32) for name, shape in SHAPES.items()}


# ---------------------------------------------------------------------------- parsing
@pytest.mark.parametrize(("text", "numel", "nbytes"), [
    ("500x", 100_000, 800), ("0.064bpp", 100_000, 800), ("800B", 1, 800),
    ("4kB", 1, 4000), ("4KiB", 1, 4096), (" 1e3x ", 4000, 16), ("1x", 10, 40),
])
def test_budgets_read_as_payload_bytes(text, numel, nbytes):
    assert parse_budget(text).payload_bytes(numel) == nbytes


@pytest.mark.parametrize("text", ["500", "x", "0x", "-5x", "0.5x", "5 bits", "nanx",
                                  "1e999x", "5xx", "0bpp"])
def test_bad_budgets_are_refused_naming_the_text(text):
    with pytest.raises(SpecError, match="budget"):
        parse_budget(text)


def test_no_budget_is_none_and_a_non_string_is_refused():
    assert parse_budget("") is None and parse_budget("  ") is None
    with pytest.raises(SpecError):
        parse_budget(500)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- family
@given(st.integers(1, 500))
def test_the_family_admits_its_template_at_every_count_and_nothing_else(k):
    family = TopKFamily(Pipeline.parse(TEMPLATE), 500)
    member = family.with_choice(k)
    assert family.match(member.spec) is not None
    assert family.match(member.spec).spec == member.spec
    for other in (f"topk:ratio=0.01,k={k}|ternary:mode=stochastic",
                  f"topk:ratio=0.02,k={k}|ternary:mode=mean",
                  f"topk:ratio=0.01,k={k},approx=true|ternary:mode=mean",
                  f"topk:ratio=0.01,k={k}|ternary:mode=mean|zstd",
                  f"topk:ratio=0.01,k={k}", f"randk:ratio=0.01,k={k}|ternary:mode=mean",
                  f"topk:ratio=0.01,k={500 + k}|ternary:mode=mean",
                  "topk:ratio=0.01|ternary:mode=mean".replace("0.01", "0.01,k=0"),
                  "topk:ratio=0.01,k=-1|ternary:mode=mean", "no such codec", "", "|" * 600):
        assert family.match(other) is None, other


@given(st.integers(1, 500), st.integers(0, len(VALUE_CHOICES) - 1))
def test_a_family_with_value_codings_admits_each_of_them_and_no_other(k, index):
    family = TopKFamily(Pipeline.parse(TEMPLATE), 500, VALUE_CHOICES)
    member = family.with_choice(k, index)
    assert member.spec.endswith(Pipeline.parse(VALUE_CHOICES[index]).spec)
    assert family.match(member.spec).spec == member.spec
    for other in (f"topk:ratio=0.01,k={k}|quant:bits=3", f"topk:ratio=0.01,k={k}|fp16",
                  f"topk:ratio=0.01,k={k}|quant:bits=4,chunk=64",
                  f"topk:ratio=0.01,k={k}|quant:bits=4|zstd", f"topk:ratio=0.01,k={k}",
                  f"topk:ratio=0.01,k={k}|ternary:mode=stochastic"):
        assert family.match(other) is None, other
    with pytest.raises(ValueError, match="value coding"):
        family.with_choice(k, len(VALUE_CHOICES))


def test_a_budget_needs_an_exact_top_k_first():
    for spec in ("quant:bits=4", "randk:ratio=0.01|quant:bits=4",
                 "topk:ratio=0.01,approx=true|quant:bits=4"):
        with pytest.raises(SpecError, match="exact Top-K"):
            CompressionPolicy(spec, budgeted=True)


def test_value_bits_follow_the_value_codec():
    assert value_bits(Pipeline.parse("topk|quant:bits=4")) == 4
    assert value_bits(Pipeline.parse("topk|ternary:mode=mean")) == 1  # no zero after Top-K
    assert value_bits(Pipeline.parse("topk|ternary")) == pytest.approx(1.6)
    assert value_bits(Pipeline.parse("topk|fp16")) == 16
    assert value_bits(Pipeline.parse("topk")) == 32


def _kept_energy_measured(values: np.ndarray, k: int, tail: str, seed: int) -> float:
    """Energy of the k largest entries less the squared error of coding them (in
    the order of their positions, as Top-K hands them on)."""
    kept = values[np.sort(np.argsort(-np.abs(values))[:k])]
    decoded = Pipeline.parse(tail).decode(
        Pipeline.parse(tail).encode(kept, rng=np.random.default_rng(seed)),
        max_numel=kept.size)
    return float(np.sum(kept.astype(np.float64) ** 2)
                 - np.sum((kept.astype(np.float64) - decoded) ** 2))


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 3000))
def test_the_ternary_model_is_exact_and_the_uniform_one_near_the_measured_error(seed, k):
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal(5000) * np.exp(rng.standard_normal(5000))).astype(np.float32)
    ordered = np.sort(np.abs(values).astype(np.float64))[::-1]
    counts = np.array([k])
    assert TERNARY.kept_energy(ordered, counts)[0] == pytest.approx(
        _kept_energy_measured(values, k, "ternary:mode=mean", seed), rel=1e-4)
    for bits in (2, 4):
        model = ValueModel.of(Pipeline.parse(f"quant:bits={bits}").stages)
        lost = ordered[:k] @ ordered[:k] - model.kept_energy(ordered, counts)[0]
        measured = np.mean([ordered[:k] @ ordered[:k]
                            - _kept_energy_measured(values, k, f"quant:bits={bits}", s)
                            for s in range(8)])
        # The model takes a chunk's range from the values' ranks, not their order: a
        # factor, not a digit, is what it must get right to rank the codings.
        rounding = 1e-6 * (ordered[:k] @ ordered[:k])  # float32 decoding of exact values
        assert measured / 4 - rounding <= lost <= measured * 4 + rounding, (bits, lost,
                                                                              measured)


# ---------------------------------------------------------------------------- allocation
def _models(tensors, policy=AUTO):
    return {name: policy.family_for(value.shape, name).models for name, value in tensors.items()}


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.floats(200, 200_000), st.sampled_from([POLICY, AUTO]))
def test_the_allocation_fits_the_estimate_and_is_pure(seed, budget_bits, policy):
    tensors = _update(seed)
    models = _models(tensors, policy)
    allocator = Allocator(tensors, models)
    choices = allocator.allocate(budget_bits)
    assert choices == Allocator(tensors, models).allocate(budget_bits)
    assert set(choices) == set(tensors)

    def bits(name: str, choice: Choice) -> float:
        if choice.count == 0:  # left out: no bytes
            return 0.0
        return float(models[name][choice.values].cost_bits(tensors[name].size,
                                                            np.array([choice.count]))[0])

    total = sum(bits(n, c) for n, c in choices.items())
    assert total <= budget_bits + 1e-6
    assert total == pytest.approx(allocator.estimated_bits(choices))
    assert all(h.choices[0] == Choice(0) and h.bits[0] == 0 for h in allocator.hulls.values())
    # Every choice is a hull point but at most one, which lies between two neighbours
    # of its hull in the same coding (the top-up); no tensor's next hull step (for one
    # left out, its first) still fits.
    between = []
    for name, choice in choices.items():
        assert 0 <= choice.values < len(models[name])
        hull = allocator.hulls[name]
        if choice in hull.choices:
            i = hull.choices.index(choice)
            assert i + 1 == len(hull.bits) or total + hull.bits[i + 1] - hull.bits[i] \
                > budget_bits, name
        else:
            between.append(name)
            below = max((c for c in hull.choices if c.values == choice.values
                         and 0 < c.count < choice.count), key=lambda c: c.count)
            above = hull.choices[hull.choices.index(below) + 1]
            assert above.values == choice.values and choice.count < above.count
            assert total + bits(name, above) - bits(name, choice) > budget_bits
    assert len(between) <= 1


def test_more_energy_earns_more_entries_and_a_larger_budget_never_fewer():
    base = _update(0)
    tensors = {"a": base["fc1.weight"], "b": base["fc1.weight"][::-1].copy() * 10}
    allocator = Allocator(tensors, {"a": [TERNARY], "b": [TERNARY]})
    choices = allocator.allocate(20_000)
    assert choices["b"].count > choices["a"].count
    totals = [sum(c.count for c in allocator.allocate(bits).values())
              for bits in (2_000, 8_000, 32_000, 128_000)]
    assert totals == sorted(totals) and totals[0] < totals[-1]


def test_worth_weights_are_one_for_energy_and_one_over_the_fresh_rms_adaptive():
    fresh = {"a": np.full(8, 0.5, np.float32), "b": np.arange(4, dtype=np.float32),
             "still": np.zeros(3, np.float32)}
    assert worth_weights("energy", fresh) == {"a": 1.0, "b": 1.0, "still": 1.0}
    adaptive = worth_weights("adaptive", fresh)
    assert adaptive["a"] == pytest.approx(2.0) and adaptive["b"] == pytest.approx((4 / 14) ** 0.5)
    assert adaptive["still"] == 1.0  # no fresh energy: no scale to divide by
    for measure in ("gradient", "normalized"):
        with pytest.raises(SpecError, match=repr(measure)):
            worth_weights(measure, fresh)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.floats(-3, 3), st.floats(2_000, 60_000))
def test_adaptive_worth_counts_a_tensors_scale_as_energy_counts_its_square_root(
        seed, log_scale, budget_bits):
    """Scaling one tensor (its fresh delta and so its compensated update) by ``c``
    multiplies its energy by ``c^2`` and its weight ``1 / rms`` by ``1 / c``: the
    adaptive choices are those of that tensor scaled by ``sqrt(c)`` under the
    weights of the unscaled update. Plain energy is a weight of 1 everywhere."""
    base = _update(seed)
    scale = 10.0 ** log_scale

    def scaled(factor):
        return {**base, "conv2.weight": base["conv2.weight"] * np.float32(factor)}

    models = {name: MODELS for name in SHAPES}
    update = scaled(scale)
    assert Allocator(update, models, worth_weights("adaptive", update)).allocate(
        budget_bits) == Allocator(scaled(scale ** 0.5), models,
                                  worth_weights("adaptive", base)).allocate(budget_bits)
    assert Allocator(base, models, worth_weights("energy", base)).allocate(budget_bits) \
        == Allocator(base, models).allocate(budget_bits)


def test_a_heavier_weight_moves_bits_to_its_tensor():
    base = _update(0)
    tensors = {"a": base["fc1.weight"], "b": base["fc1.weight"][::-1].copy()}
    plain = Allocator(tensors, {"a": [TERNARY], "b": [TERNARY]}).allocate(20_000)
    heavy = Allocator(tensors, {"a": [TERNARY], "b": [TERNARY]},
                      {"a": 100.0}).allocate(20_000)
    assert heavy["a"].count > plain["a"].count and heavy["b"].count < plain["b"].count
    lifted = Allocator({"a": tensors["a"] * 10, "b": tensors["b"]},
                       {"a": [TERNARY], "b": [TERNARY]}).allocate(20_000)
    assert heavy == lifted  # a weight of 100 on the energy is a scale of 10 on the values


def test_the_run_config_weighs_only_the_uplink_by_budget_worth():
    config = RunConfig.from_mapping({"uplink-budget": "400x", "downlink-budget": "40x",
                                     "downlink-codec": "topk", "budget-worth": "adaptive"})
    assert config.uplink_policy.budget_worth == "adaptive"
    assert config.downlink_policy.budget_worth == "energy"


def test_an_adaptive_budget_sends_a_large_layer_of_small_entries_more_than_energy_does():
    """fc1's entries move 0.8 times as much as the others': plain energy leaves it
    out, counted over its rms (a fifth of its energy given back) it is sent."""
    budget = parse_budget("300x").payload_bytes(NUMEL)
    update = _update(3, {"fc1.weight": 0.8})
    sent = {}
    for measure in ("energy", "adaptive"):
        policy = CompressionPolicy(TEMPLATE, "quant:bits=8", 1024, budgeted=True,
                                   budget_values=VALUE_CHOICES, budget_worth=measure)
        result = encode_within_budget(update, policy, budget, rng=np.random.default_rng(0),
                                      meta={"round": 1})
        assert len(result.payload) <= budget
        sent[measure] = result.choices["fc1.weight"].count
    assert sent["energy"] == 0 and sent["adaptive"] > 0, sent


def test_alike_values_get_one_sign_bit_and_spread_values_more_bits():
    """Ternary codes values of one magnitude exactly, so no budget buys them more
    bits; values spread over orders of magnitude lose most of their energy to one
    mean, so a budget that can afford it codes them in more bits."""
    rng = np.random.default_rng(0)
    alike = np.where(rng.random(4096) < 0.5, -1.0, 1.0).astype(np.float32)
    spread = (rng.standard_normal(4096) * np.exp(2 * rng.standard_normal(4096))
              ).astype(np.float32)
    for bits in (500.0, 5_000.0, 50_000.0):
        assert Allocator({"a": alike}, {"a": MODELS}).allocate(bits)["a"].values == 0
    rich = Allocator({"s": spread}, {"s": MODELS}).allocate(40_000.0)["s"]
    assert VALUE_CHOICES[rich.values] != "ternary:mode=mean"


def test_the_next_target_corrects_a_fixed_miss_then_follows_the_secant():
    # Estimate 8,000 bits made 1,400 bytes of a 1,000-byte budget: aim at 985 bytes.
    first = next_target([(8000.0, 1400)], 1000)
    assert first == pytest.approx(8000 - 8 * 415)
    # Bytes = 200 + estimate / 10: the secant through two tries lands on the aim.
    tries = [(8000.0, 1000), (4000.0, 600)]
    assert next_target(tries, 1000) == pytest.approx((985 - 200) * 10)
    # A try that shrank as the estimate grew is no slope: back to the miss.
    assert next_target([(8000.0, 900), (9000.0, 800)], 1000) == pytest.approx(
        9000 + 8 * 185)
    # Tries on both sides of the aim: the chord between the closest of each side.
    tries = [(1000.0, 500), (5000.0, 1200), (3000.0, 900), (4000.0, 1100)]
    assert 3000 < next_target(tries, 1000) < 4000


# ---------------------------------------------------------------------------- encoding
@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(["100x", "300x", "1000x", "3000x"]),
       st.sampled_from([TEMPLATE, "topk:ratio=0.01|quant:bits=4",
                        "topk:ratio=0.01|quant:bits=2|zstd"]), st.booleans())
def test_a_budgeted_payload_never_exceeds_the_budget_and_decodes_strictly(seed, text, spec,
                                                                          auto):
    policy = CompressionPolicy(spec, "quant:bits=8", 1024, budgeted=True,
                               budget_values=VALUE_CHOICES if auto else ())
    budget = parse_budget(text).payload_bytes(NUMEL)
    memory = ErrorFeedback(policy.description)
    for server_round in range(3):
        delta = _update(seed + server_round)
        try:
            update = encode_within_budget(delta, policy, budget, rng=np.random.default_rng(
                seed), feedback=memory, meta={"round": server_round})
        except BudgetError:
            assert budget < minimum_payload_bytes(policy, SHAPES) * 1.2
            return
        assert update.nbytes <= budget
        decoded = unpack_payload(update.payload, expected=policy.expected(SHAPES))
        for name, value in decoded.tensors.items():
            np.testing.assert_array_equal(value, np.asarray(update.decoded[name]))
            assert policy.family_for(SHAPES[name], name) is not None  # every tensor
            assert np.count_nonzero(value) <= update.choices[name].count
            if update.choices[name].count == 0:  # left out: absent, decoded as zeros
                assert name not in decoded.pipelines and name not in decoded.specs
                continue
            assert decoded.pipelines[name].spec == policy.family_for(
                SHAPES[name], name).with_choice(update.choices[name].count,
                                                update.choices[name].values).spec


@pytest.mark.parametrize("text", ["100x", "300x", "1000x"])
def test_the_payload_spends_nearly_all_of_the_budget(text):
    """Headers and scales do not scale with the allocation: a fit that only rescales
    the estimate lands far under a small budget. (At twice the floor and less, one
    more entry may cost more than is left: no fraction is promised there.)"""
    budget = parse_budget(text).payload_bytes(NUMEL)
    assert budget > 2 * minimum_payload_bytes(AUTO, SHAPES)
    for seed in range(6):
        update = encode_within_budget(_update(seed), AUTO, budget,
                                      rng=np.random.default_rng(seed), meta={"round": 1})
        assert 0.9 * budget <= update.nbytes <= budget, (text, seed, update.nbytes, budget)


def test_error_feedback_keeps_exactly_what_the_budget_did_not_send():
    memory = ErrorFeedback(POLICY.description)
    budget = parse_budget("500x").payload_bytes(NUMEL)
    sent = {name: np.zeros(shape, np.float64) for name, shape in SHAPES.items()}
    inputs = {name: np.zeros(shape, np.float64) for name, shape in SHAPES.items()}
    for server_round in range(4):
        delta = _update(server_round)
        update = encode_within_budget(delta, POLICY, budget, rng=np.random.default_rng(0),
                                      feedback=memory, meta={"round": server_round})
        for name in SHAPES:
            inputs[name] += delta[name]
            sent[name] += np.asarray(update.decoded[name], np.float64)
    residual = memory.memory
    for name in SHAPES:
        np.testing.assert_allclose(sent[name] + residual[name], inputs[name], atol=1e-4)


SMALL_FIXED = CompressionPolicy(TEMPLATE, "ternary:mode=mean", 1024, budgeted=True,
                                budget_values=VALUE_CHOICES, budget_small_fixed=True)


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(["100x", "300x", "1000x"]))
def test_small_tensors_fixed_under_a_budget_are_sent_whole_every_time(seed, text):
    """With ``budget_small_fixed`` the tensors under ``min_numel`` leave the budget's
    choice: every payload carries each of them whole in ``small_codec`` (a sign and
    a scale here), within the same budget, and the larger tensors share the rest. A
    codec that dropped one, or budgeted it, would decode it to fewer non-zeros or to
    another pipeline."""
    small = [name for name, shape in SHAPES.items() if math.prod(shape) < 1024]
    assert small == ["conv1.weight", "conv1.bias"]
    budget = parse_budget(text).payload_bytes(NUMEL)
    memory = ErrorFeedback(SMALL_FIXED.description)
    sign = Pipeline.parse("ternary:mode=mean")
    for server_round in range(3):
        delta = _update(seed + server_round)
        compensated = memory.compensate(delta)
        update = encode_within_budget(delta, SMALL_FIXED, budget,
                                      rng=np.random.default_rng(seed), feedback=memory,
                                      meta={"round": server_round})
        assert update.nbytes <= budget
        assert set(update.choices) == set(SHAPES) - set(small)
        decoded = unpack_payload(update.payload, expected=SMALL_FIXED.expected(SHAPES))
        for name in small:
            assert SMALL_FIXED.family_for(SHAPES[name], name) is None
            assert decoded.pipelines[name].spec == sign.spec
            expected = sign.decode_tensor(sign.encode(compensated[name],
                                                      rng=np.random.default_rng(0)),
                                          SHAPES[name])
            np.testing.assert_allclose(decoded.tensors[name], expected, rtol=1e-6)
            assert np.count_nonzero(decoded.tensors[name]) == math.prod(SHAPES[name])
        assert sum(update.choices[name].count for name in update.choices) > 0


def test_fixing_the_small_tensors_changes_the_feedback_key_and_the_floor():
    """Error feedback saved under one rule must not resume under the other, and the
    smallest payload now holds every small tensor whole."""
    budgeted = CompressionPolicy(TEMPLATE, "ternary:mode=mean", 1024, budgeted=True,
                                 budget_values=VALUE_CHOICES)
    assert SMALL_FIXED.description != budgeted.description
    assert minimum_payload_bytes(SMALL_FIXED, SHAPES) > minimum_payload_bytes(budgeted, SHAPES) \
        + (288 + 32) // 8
    assert budgeted.pipeline_for((32,)) is budgeted.pipeline_for((1024,))
    unbudgeted = CompressionPolicy(TEMPLATE, "ternary:mode=mean", 1024,
                                   budget_small_fixed=True)
    assert unbudgeted.pipeline_for((32,)).spec == "ternary:mode=mean"
    assert unbudgeted.family_for((64, 32, 3, 3)) is None


def test_a_starved_tensor_is_sent_more_as_its_residual_grows():
    """fc1 moves a little, always the same way; the other tensors a lot, at random.
    Without memory fc1 is never worth its bytes and is left out every round; with
    error feedback its residual grows faster than the others' random walks, earns it
    entries, and part of its drift reaches the server."""
    budget = parse_budget("300x").payload_bytes(NUMEL)
    drift = _update(99)["fc1.weight"] * 0.2

    def delivered(memory) -> float:
        total = np.zeros_like(drift, dtype=np.float64)
        for r in range(12):
            delta = {**_update(r), "fc1.weight": drift}
            total += encode_within_budget(delta, POLICY, budget, rng=np.random.default_rng(0),
                                          feedback=memory, meta={"round": r}
                                          ).decoded["fc1.weight"]
        cumulative = 12 * drift.astype(np.float64)
        return float(np.vdot(total, cumulative) / np.vdot(cumulative, cumulative))

    with_feedback, memoryless = delivered(ErrorFeedback(POLICY.description)), delivered(
        NoFeedback())
    assert with_feedback > 0.02 and with_feedback > 4 * memoryless, (with_feedback, memoryless)


def test_a_budget_below_the_smallest_payload_is_refused():
    for policy in (POLICY, AUTO):
        floor = minimum_payload_bytes(policy, SHAPES)
        assert 0 < floor < 4 * NUMEL
        with pytest.raises(BudgetError, match="smallest payload"):
            encode_within_budget(_update(0), policy, floor // 2, rng=np.random.default_rng(0))
        encode_within_budget(_update(0), policy, int(floor * 1.05) + 16,
                             rng=np.random.default_rng(0))


def test_the_receiver_refuses_a_count_outside_the_tensor_or_another_value_codec():
    update = _update(0)
    expected = POLICY.expected(SHAPES)
    too_many = TopKFamily(Pipeline.parse(TEMPLATE), 10**6)
    for pipeline in (too_many.with_choice(20_000),  # conv2 has 18,432 entries
                     Pipeline.parse("topk:ratio=0.01,k=5|ternary:mode=stochastic"),
                     Pipeline.parse("topk:ratio=0.01,k=5|quant:bits=4")):  # not in POLICY
        payload = encode_update(update, POLICY, rng=np.random.default_rng(0),
                                meta={"round": 0},
                                pipelines={"conv2.weight": pipeline}).payload
        with pytest.raises(PayloadError, match="family") as info:
            unpack_payload(payload, expected=expected)
        assert info.value.reason == "codec"


def test_a_budgeted_tensor_left_out_decodes_to_zeros_and_a_fixed_one_may_not_be():
    """Leaving a tensor out saves its header entry and scale, not only its values; the
    receiver reads its absence as a zero update. A tensor in a fixed (override)
    pipeline has no such choice, and a payload without it is refused."""
    update = _update(3)
    left_out = {"conv1.bias": None, "fc2.weight": None}
    payload = encode_update(update, POLICY, rng=np.random.default_rng(0), meta={"round": 0},
                            pipelines=left_out).payload
    full = encode_update(update, POLICY, rng=np.random.default_rng(0), meta={"round": 0}).payload
    assert len(payload) < len(full)
    decoded = unpack_payload(payload, expected=POLICY.expected(SHAPES))
    assert set(decoded.tensors) == set(SHAPES)
    for name in left_out:
        assert decoded.tensors[name].shape == SHAPES[name] and not decoded.tensors[name].any()
        assert name not in decoded.pipelines
    assert decoded.tensors["fc1.weight"].any()
    pinned = CompressionPolicy(TEMPLATE, "quant:bits=8", 1024, budgeted=True,
                               overrides=(("fc2.*", "quant:bits=8"),))
    with pytest.raises(PayloadError, match="another layout"):  # its dictionary differs
        unpack_payload(payload, expected=pinned.expected(SHAPES))
    plain = encode_update(update, POLICY, rng=np.random.default_rng(0), meta={"round": 0},
                          pipelines=left_out, layout_dictionary=False).payload
    assert unpack_payload(plain, expected=POLICY.expected(SHAPES)).tensors.keys() == SHAPES.keys()
    with pytest.raises(PayloadError, match=r"lacks tensors \['fc2.weight'\]") as info:
        unpack_payload(plain, expected=pinned.expected(SHAPES))
    assert info.value.reason == "model"
    with pytest.raises(ValueError, match="error feedback"):
        encode_update(update, POLICY, rng=np.random.default_rng(0), pipelines=left_out,
                      feedback=ErrorFeedback(POLICY.description))


def test_the_layout_dictionary_holds_the_family_members_so_their_headers_shrink():
    """Both sides add headers of a few members of each budgeted tensor's family to
    the layout dictionary: a header in another value coding than the template's,
    at counts off the template's, then compresses far better, and decodes."""
    update = _update(5)
    family = {name: AUTO.family_for(shape, name) for name, shape in SHAPES.items()}
    tensors, bare = [], []
    for index, (name, value) in enumerate(update.items()):
        pipeline = family[name].with_choice(13 + 7 * index, 2)  # 4-bit, odd counts
        root = pipeline.encode(value, rng=np.random.default_rng(index))
        template = AUTO.pipeline_for(SHAPES[name], name).spec
        tensors.append(EncodedTensor(name, SHAPES[name], pipeline, root, template,
                                     family[name].dictionary_specs()))
        bare.append(EncodedTensor(name, SHAPES[name], pipeline, root, template))
    rich = pack_payload(tensors, {"round": 2}, use_layout_dictionary=True)
    plain = pack_payload(bare, {"round": 2}, use_layout_dictionary=True)
    assert len(rich) < len(plain) - 4 * len(SHAPES), (len(rich), len(plain))
    decoded = unpack_payload(rich, expected=AUTO.expected(SHAPES))
    for tensor in tensors:
        np.testing.assert_array_equal(decoded.tensors[tensor.name],
                                      tensor.pipeline.decode_tensor(tensor.root, tensor.shape))
    with pytest.raises(PayloadError, match="another layout"):
        unpack_payload(plain, expected=AUTO.expected(SHAPES))


# ---------------------------------------------------------------------------- run config
@pytest.mark.parametrize(("values", "fragment"), [
    ({"uplink-budget": "fast"}, "'uplink-budget'"),
    ({"uplink-budget": "500x", "codec": "quant:bits=4"}, "exact Top-K"),
    ({"uplink-budget": "500x", "shared-randk": 0.1}, "cannot be combined"),
    ({"uplink-budget": "500x", "budget-values": "all"}, "'budget-values'.*'all'"),
    ({"uplink-budget": "500x", "budget-worth": "curvature"}, "'budget-worth'.*'curvature'"),
])
def test_run_config_refuses_bad_budgets(values, fragment):
    with pytest.raises(SpecError, match=fragment):
        RunConfig.from_mapping(values)


def test_run_config_refuses_a_budget_below_the_model_floor_naming_what_fits():
    cfg = RunConfig.from_mapping({"uplink-budget": "100000x", "codec": TEMPLATE})
    with pytest.raises(SpecError, match=r"smallest payload of this model: [\d,]+ bytes.*"
                                        r"one of 5 budgeted tensors and no other tensor.*"
                                        r"use at most '\d+x'"):
        cfg.check_budgets(SHAPES)
    pinned = RunConfig.from_mapping({"uplink-budget": "100000x", "codec": TEMPLATE,
                                     "codec-overrides": "conv1.*=quant:bits=8"})
    with pytest.raises(SpecError,
                       match="one of 3 budgeted tensors and 2 tensors in their override"):
        pinned.check_budgets(SHAPES)
    small = RunConfig.from_mapping({"uplink-budget": "100000x", "codec": TEMPLATE,
                                    "budget-small-tensors": "small-codec",
                                    "small-codec": "ternary:mode=mean"})
    with pytest.raises(SpecError, match="one of 3 budgeted tensors and 2 tensors under "
                                        "min-numel whole in small-codec 'ternary:mode=mean'"):
        small.check_budgets(SHAPES)
    with pytest.raises(SpecError, match=r"'budget-small-tensors'.*'fixed'"):
        RunConfig.from_mapping({"uplink-budget": "500x", "budget-small-tensors": "fixed"})
    RunConfig.from_mapping({"uplink-budget": "200x"}).check_budgets(SHAPES)
    with pytest.raises(SpecError, match="'downlink-budget'"):
        RunConfig.from_mapping({"downlink-budget": "100000x"}).check_budgets(SHAPES)
    assert RunConfig().uplink_budget_bytes(SHAPES) is None
    assert RunConfig.from_mapping({"uplink-budget": "1000B"}).uplink_budget_bytes(SHAPES) == 1000


def test_a_budget_that_codes_values_in_fp32_is_noted_naming_the_key():
    # budget-values = "codec" holds both ways: a bare Top-K downlink then sends fp32
    # values, which a run prints a note about before round 1.
    bare_down = RunConfig.from_mapping({
        "uplink-budget": "400x", "downlink-budget": "40x", "budget-values": "codec",
        "codec": "topk|ternary:mode=mean", "downlink-codec": "topk"})
    assert len(bare_down.notices) == 1
    assert "'downlink-codec' = 'topk' has no value stage" in bare_down.notices[0]
    assert "downlink budget sends every kept value in fp32" in bare_down.notices[0]
    both_bare = bare_down.replace(codec="topk")
    assert [n.split(" = ")[0] for n in both_bare.notices] == [
        "run config 'codec'", "run config 'downlink-codec'"]
    for quiet in (bare_down.replace(downlink_codec="topk|quant:bits=4"),
                  bare_down.replace(budget_values="auto"),
                  bare_down.replace(downlink_budget=""),
                  RunConfig.from_mapping({"codec": "topk", "downlink-codec": "topk"})):
        assert quiet.notices == ()


def test_the_server_reads_each_clients_choices_from_its_payload():
    budget = parse_budget("500x").payload_bytes(NUMEL)
    replies, sent = [], {}
    for node in (1, 2, 3):
        update = encode_within_budget(_update(node), AUTO, budget,
                                      rng=np.random.default_rng(node), meta={"round": 4})
        replies.append(ClientReply(node, update.payload, 10.0))
        sent[node] = {name: (c.count, MODELS[c.values].bits if c.count else 0.0)
                      for name, c in update.choices.items()}
    expected = AUTO.expected(SHAPES)
    result = aggregate_deltas(replies, expected, expected_meta={"round": 4})
    assert result.accepted == [1, 2, 3] and result.kept == sent
    record, metrics = RoundRecord(round=4), {1: {}, 2: {}, 3: {}}
    record_densities(result.kept, expected, record, metrics)
    budgeted = sum(math.prod(SHAPES[n]) for n in sent[1])
    for node in sent:
        entries = sum(k for k, _ in sent[node].values())
        assert metrics[node]["uplink-density"] == pytest.approx(entries / budgeted)
        assert metrics[node]["uplink-value-bits"] == pytest.approx(
            sum(k * b for k, b in sent[node].values()) / entries)
    assert record.uplink_density == pytest.approx(
        np.mean([m["uplink-density"] for m in metrics.values()]))
    assert record.uplink_value_bits == pytest.approx(
        np.mean([m["uplink-value-bits"] for m in metrics.values()]))
    shares = dict(item.split("=") for item in record.uplink_tensor_density.split(";"))
    assert set(shares) == set(sent[1])
    assert float(shares["fc1.weight"]) == pytest.approx(
        np.mean([s["fc1.weight"][0] for s in sent.values()]) / (128 * 784), rel=1e-5)
    carried = dict(item.split("=") for item in record.uplink_tensor_sent.split(";"))
    for name in sent[1]:
        assert float(carried[name]) == pytest.approx(
            np.mean([s[name][0] > 0 for s in sent.values()]), rel=1e-5)


# ---------------------------------------------------------------------------- downlink
@pytest.mark.parametrize("mode", ["shared", "per-client"])
@pytest.mark.parametrize("wire_header", ["json", "predicted"])
def test_a_budgeted_downlink_stays_within_it_and_replicas_match_the_server(mode,
                                                                           wire_header):
    from fedcomp.federated.downlink import Recipient, Replica, make_downlink, model_digest

    policy = CompressionPolicy("topk:ratio=0.01|quant:bits=4", "quant:bits=8", 1024,
                               budgeted=True, budget_values=VALUE_CHOICES,
                               wire_header=wire_header)
    rng = np.random.default_rng(3)
    initial = _update(50)
    budget = parse_budget("300x").payload_bytes(NUMEL)
    server = make_downlink(mode, initial, policy, history=10, seed=0, shared_init=True,
                           budget=budget)
    replica, who = Replica(), Recipient(node=1, key="c0", stream=0)
    compressed = 0
    for _ in range(4):
        target = {k: v + rng.standard_normal(v.shape).astype(np.float32) * 0.01
                  for k, v in server.model.items()}
        server.publish(target)
        message = server.send(who)
        # The server's record of what its budget chose (one entry per budgeted
        # payload made: the published update, or this client's catch-up) is what the
        # payload holds.
        kept = server.take_kept()
        assert server.take_kept() == []
        if message.kind != "full":
            compressed += 1
            assert all(len(p) <= budget for p in message.payloads)
            # The flags byte: the predicted header wherever it was asked for.
            assert all((p[5] == 4) == (wire_header == "predicted") for p in message.payloads)
            assert len(kept) == 1 and set(kept[0]) == set(SHAPES)
            decoded = unpack_payload(message.payloads[-1], expected=policy.expected(SHAPES))
            for name, (count, bits) in kept[0].items():
                pipeline = decoded.pipelines.get(name)
                assert count == (0 if pipeline is None else
                                 topk_count(pipeline, math.prod(SHAPES[name])))
                assert bits == (0.0 if pipeline is None else value_bits(pipeline))
            record = RoundRecord(round=1)
            record_downlink_densities(kept, server.shapes, record)
            entries = sum(k for k, _ in kept[0].values())
            assert record.downlink_density == pytest.approx(entries / NUMEL)
            assert len(record.downlink_tensor_density.split(";")) == len(SHAPES)
            assert record.downlink_tensor_sent == ";".join(
                f"{name}={float(kept[0][name][0] > 0):g}" for name in SHAPES)
        replica.apply(message, server.shapes, policy, initial=initial)
        server.applied(who)
        assert model_digest(replica.model) == server.digest_for(who)
    assert compressed >= 3


def test_relative_worth_divides_by_the_tensors_squared_norm_and_its_fresh_energy():
    fresh = {"a": np.full(4, 0.5, np.float32), "zero": np.full(2, 2.0, np.float32),
             "still": np.zeros(3, np.float32)}
    model = {"a": np.full(4, 1.5, np.float32), "zero": np.zeros(2, np.float32),
             "still": np.zeros(3, np.float32), "unbudgeted": np.ones(5, np.float32)}
    relative = worth_weights("relative", fresh, model)
    assert relative["a"] == pytest.approx(1 / (9.0 + 1.0))
    assert relative["zero"] == pytest.approx(1 / 8.0)  # a zero tensor: its fresh update's
    assert relative["still"] == 1.0  # nothing to divide by
    with pytest.raises(SpecError, match="needs the model"):
        worth_weights("relative", fresh)
    with pytest.raises(SpecError, match="lacks still"):
        worth_weights("relative", fresh, {"a": model["a"], "zero": model["zero"]})


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(-10, 10), st.floats(2_000, 60_000))
def test_relative_worth_ignores_a_tensors_scale(seed, log2_scale, budget_bits):
    """Scaling one tensor's model values and its update by the same ``c`` (a layer
    reparametrised) leaves its relative change, and so every choice, as it was:
    plain energy would move bits to or from it. (Powers of two scale floats exactly.)"""
    base = _update(seed)
    rng = np.random.default_rng(seed + 1)
    model = {name: rng.standard_normal(value.shape).astype(np.float32)
             for name, value in base.items()}
    scale = np.float32(2.0 ** log2_scale)
    models = {name: MODELS for name in SHAPES}
    scaled = {**base, "conv2.weight": base["conv2.weight"] * scale}
    scaled_model = {**model, "conv2.weight": model["conv2.weight"] * scale}
    assert Allocator(scaled, models, worth_weights("relative", scaled, scaled_model)).allocate(
        budget_bits) == Allocator(base, models, worth_weights("relative", base, model)
                                  ).allocate(budget_bits)


def test_a_relative_budget_sends_a_small_scaled_layer_that_energy_leaves_out():
    """conv2's model values and update are a tenth of the others': energy spends the
    budget elsewhere, its relative change is as large as theirs and it is sent."""
    budget = parse_budget("300x").payload_bytes(NUMEL)
    update = _update(3, {"conv2.weight": 0.1})
    rng = np.random.default_rng(7)
    model = {name: rng.standard_normal(value.shape).astype(np.float32)
             * np.float32(0.1 if name == "conv2.weight" else 1.0)
             for name, value in update.items()}
    sent = {}
    for measure in ("energy", "relative"):
        policy = CompressionPolicy(TEMPLATE, "quant:bits=8", 1024, budgeted=True,
                                   budget_values=VALUE_CHOICES, budget_worth=measure)
        result = encode_within_budget(update, policy, budget, rng=np.random.default_rng(0),
                                      meta={"round": 1}, model=model)
        assert len(result.payload) <= budget
        sent[measure] = result.choices["conv2.weight"].count
    assert sent["relative"] > 2 * sent["energy"], sent
    policy = CompressionPolicy(TEMPLATE, "quant:bits=8", 1024, budgeted=True,
                               budget_worth="relative")
    with pytest.raises(SpecError, match="needs the model"):
        encode_within_budget(update, policy, budget, rng=np.random.default_rng(0))


# ---------------------------------------------------------------------------- balanced
@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(-10, 10), st.floats(2_000, 60_000))
def test_balanced_worth_ignores_a_tensors_scale(seed, log2_scale, budget_bits):
    """The log of the share kept does not change when a tensor's update is scaled, so
    neither does any choice; energy would move bits to or from the scaled tensor.
    (Powers of two scale floats exactly.)"""
    base = _update(seed)
    models = {name: MODELS for name in SHAPES}
    scaled = {**base, "conv2.weight": base["conv2.weight"] * np.float32(2.0 ** log2_scale)}
    assert Allocator(base, models, balanced=True).allocate(budget_bits) == \
        Allocator(scaled, models, balanced=True).allocate(budget_bits)


def test_balanced_worth_sends_every_tensor_that_energy_leaves_out():
    """A tensor whose update is a thousandth of the others' keeps nothing worth its
    header under energy; under balanced worth it keeps a share like the others',
    as a fixed Top-K ratio per tensor would."""
    update = _update(7, {"fc1.weight": 1e-3, "conv1.bias": 1e-3})
    models = {name: MODELS for name in SHAPES}
    budget_bits = 8.0 * parse_budget("300x").payload_bytes(NUMEL)
    energy = Allocator(update, models).allocate(budget_bits)
    balanced = Allocator(update, models, balanced=True).allocate(budget_bits)
    assert energy["fc1.weight"].count == 0
    assert all(choice.count > 0 for choice in balanced.values())
    allocator = Allocator(update, models, balanced=True)
    assert allocator.estimated_bits(balanced) <= budget_bits
    assert balanced == Allocator(update, models, {"fc1.weight": 1e6},
                                 balanced=True).allocate(budget_bits)  # weights ignored
    tiny = Allocator(update, models, balanced=True).allocate(50.0)  # not one entry each
    assert Allocator(update, models, balanced=True).estimated_bits(tiny) <= 50.0
    assert any(choice.count == 0 for choice in tiny.values())


@pytest.mark.parametrize("text", ["100x", "1000x"])
def test_a_balanced_budget_fits_and_the_run_config_takes_it(text):
    policy = CompressionPolicy(TEMPLATE, "quant:bits=8", 1024, budgeted=True,
                               budget_worth="balanced")
    budget = parse_budget(text).payload_bytes(NUMEL)
    memory = ErrorFeedback(policy.description)
    for server_round in range(3):
        update = encode_within_budget(_update(server_round), policy, budget,
                                      rng=np.random.default_rng(0), feedback=memory,
                                      meta={"round": server_round})
        assert update.nbytes <= budget
        assert all(choice.count > 0 for choice in update.choices.values())
    assert RunConfig.from_mapping({"uplink-budget": text, "codec": TEMPLATE,
                                   "budget-worth": "balanced"}).uplink_policy.budget_worth \
        == "balanced"


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.floats(-30.0, 5.0), st.sampled_from([POLICY, AUTO]),
       st.booleans())
def test_a_price_picks_each_hulls_first_best_point(seed, log_price, policy, balanced):
    tensors = _update(seed)
    allocator = Allocator(tensors, _models(tensors, policy), balanced=balanced)
    scale = max(float(h.energy[-1] - h.energy[0]) for h in allocator.hulls.values())
    lam = scale * math.exp(log_price)
    chosen = allocator.at_price(lam)
    assert chosen == {name: int(np.argmax(h.energy - lam * h.bits))
                      for name, h in allocator.hulls.items()}
    # A price between a hull's two neighbouring slopes picks the point between them.
    name, hull = next(iter(allocator.hulls.items()))
    if len(hull.bits) >= 3:
        slopes = np.diff(hull.energy) / np.diff(hull.bits)
        i = len(slopes) // 2
        assert allocator.at_price(0.5 * (slopes[i - 1] + slopes[i]))[name] == i
    assert Allocator({}, {}).at_price(lam) == {}


def test_the_predicted_header_lowers_the_smallest_budget():
    """MNIST-1D's transformer at 1000x (75 bytes) is below the floor with the JSON
    header (84 bytes) and above it with the predicted one."""
    from fedcomp.codecs.policy import WIRE_HEADERS, smallest_budget_bytes
    from fedcomp.tasks.models import model_shapes

    shapes = model_shapes("mnist1d")
    floors = {form: smallest_budget_bytes(
        CompressionPolicy("topk:ratio=0.01|ternary:mode=mean", budgeted=True,
                          wire_header=form), shapes) for form in WIRE_HEADERS}
    assert floors["predicted"] < floors["json"]
    settings = {"preset": "fedcomp-budget", "uplink-budget": "1000x"}
    with pytest.raises(SpecError, match="uplink-budget"):
        RunConfig.from_mapping({**settings, "wire-header": "json"}).check_budgets(shapes)
    RunConfig.from_mapping(settings).check_budgets(shapes)  # the default: predicted


def test_a_budget_too_small_for_every_tensor_says_so_and_what_would_fit():
    """MNIST-1D's transformer at 400x cannot carry one entry of each of its 31 tensors:
    the run is told so, with the largest factors that can; Fashion-MNIST's CNN at the
    goal's 1000x / 60x can, and hears nothing."""
    import re

    from fedcomp.codecs.policy import every_tensor_payload_bytes
    from fedcomp.tasks.models import model_shapes

    shapes = model_shapes("mnist1d")
    numel = sum(math.prod(s) for s in shapes.values())
    settings = {"preset": "fedcomp-budget", "uplink-budget": "400x", "downlink-budget": "40x"}
    config = RunConfig.from_mapping(settings)
    config.check_budgets(shapes)  # accepted: one tensor fits
    (notice,) = config.budget_notices(shapes)  # the 40x downlink fits every tensor
    every = every_tensor_payload_bytes(config.uplink_policy, shapes)
    assert notice.startswith("run config 'uplink-budget' '400x'")
    assert f"31 tensors, one Top-K entry of each budgeted one, take {every:,} bytes" in notice
    # The size is a payload's that sends every tensor, one Top-K entry each.
    policy = config.uplink_policy
    choices = {n: Choice(1, policy.family_for(tuple(s), n).cheapest())
               for n, s in shapes.items()}
    rng = np.random.default_rng(0)
    update = _encode_choices({n: rng.standard_normal(s).astype(np.float32)
                              for n, s in shapes.items()}, policy, choices,
                             rng=rng, meta={"round": 0})
    assert update.nbytes == every
    decoded = unpack_payload(update.payload, expected=policy.expected(shapes))
    assert sorted(decoded.pipelines) == sorted(shapes)
    assert all(np.count_nonzero(t) == 1 for t in decoded.tensors.values())
    factors = [int(x) for x in re.findall(r"at most '(\d+)x'", notice)]
    assert len(factors) == 3  # every tensor; the small ones whole in fp32, in sign bits
    # At the factor it names there is room for every tensor, and no notice.
    assert RunConfig.from_mapping({**settings, "uplink-budget": f"{factors[0]}x"}
                                  ).budget_notices(shapes) == ()
    assert 4 * numel / factors[0] >= every > 4 * numel / (factors[0] + 2)
    # The small tensors whole in sign bits: accepted at the factor named, refused above.
    fixed = {**settings, "budget-small-tensors": "small-codec",
             "small-codec": "ternary:mode=mean"}
    RunConfig.from_mapping({**fixed, "uplink-budget": f"{factors[2]}x"}).check_budgets(shapes)
    with pytest.raises(SpecError, match="uplink-budget"):
        RunConfig.from_mapping({**fixed, "uplink-budget": f"{factors[2] + 2}x"}
                               ).check_budgets(shapes)
    fashion = RunConfig.from_mapping({**settings, "uplink-budget": "1000x",
                                      "downlink-budget": "60x"})
    assert fashion.budget_notices(model_shapes("fashion-mnist")) == ()
