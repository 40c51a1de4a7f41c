"""The run configuration: every key of ``[tool.flwr.app.config]``, typed and validated.

Flower hands the ServerApp and every ClientApp ``context.run_config``, a flat dict
with kebab-case keys (``local-epochs``). :meth:`RunConfig.from_mapping` turns it into
one frozen object, refusing unknown keys (a typo in ``--run-config`` would otherwise
be silently ignored), wrong types and out-of-range values with a message that names
the key and the value. Codec specs are parsed here too, so a bad spec stops the run
before the first round.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from fedcomp.codecs.budget import VALUE_CHOICES, WORTH_MEASURES, ByteBudget, parse_budget
from fedcomp.codecs.pipeline import Pipeline
from fedcomp.codecs.policy import (
    WIRE_HEADERS,
    CompressionPolicy,
    encoder_fingerprint,
    every_tensor_payload_bytes,
    parse_overrides,
    smallest_budget_bytes,
)
from fedcomp.codecs.wire import ExpectedTensor
from fedcomp.errors import SpecError
from fedcomp.federated.faults import FAULT_KINDS, AttackPlan, FaultPlan
from fedcomp.federated.robust import AggregationRule, parse_rule
from fedcomp.presets import PRESETS
from fedcomp.presets import expand as expand_presets
from fedcomp.privacy.subspace import RandomSubspace

__all__ = ["RunConfig", "config_key"]

_CHOICES = {
    "dataset": ("digits", "fashion-mnist", "mnist1d"),
    "partitioning": ("iid", "dirichlet", "pathological"),
    # EF21 (fedcomp.codecs.feedback.EF21) stays a library memory: a run would need the
    # server to keep every client's estimate and aggregate estimates, not updates.
    "feedback": ("ef", "none"),
    "server_optimizer": ("sgd", "momentum", "adam", "yogi"),
    "server_lr_schedule": ("constant", "cosine"),
    "norm_action": ("reject", "clip"),
    "dp": ("none", "client", "sample"),
    "dp_accountant": ("pld", "rdp"),
    # shared: one compressed model for all (fedcomp.federated.downlink.Broadcaster); per-client:
    # each client's own difference (fedcomp.federated.downlink.PerClientBroadcaster).
    "downlink_mode": ("shared", "per-client"),
    # budgeted: every tensor's share chosen by the budget; small-codec: tensors under
    # min-numel sent whole in small-codec in every payload, the budget allocating the rest.
    "budget_small_tensors": ("budgeted", "small-codec"),
    # json: the header as JSON against the layout dictionary; predicted: also the
    # predicted header (fedcomp.codecs.compact_header), where it is smaller.
    "wire_header": WIRE_HEADERS,
}


#: Defaults that changed after runs were recorded: the run id compares a setting with
#: its value *before* the change, so an old run's id still names what it ran (a run
#: with the new default gets a new id).
_DIGEST_BASELINE = {"norm-bound": 0.0, "norm-action": "reject", "weight-cap": 0.0,
                    "downlink-codec": "none", "downlink-mode": "shared", "wire-header": "json"}
#: Client-level DP applies neither bound (:meth:`RunConfig.influence_bounds`): they enter
#: its run id at the values its runs were first recorded with, whatever the defaults.
_CLIENT_DP_ID_BOUNDS = {"norm-bound": 3.0, "weight-cap": 3.0}


def _budget_bytes(text: str, shapes: Mapping[str, Any]) -> int | None:
    budget = parse_budget(text)
    if budget is None:
        return None
    return budget.payload_bytes(sum(math.prod(shape) for shape in shapes.values()))


def _defaults() -> dict[str, Any]:
    """Field name -> default value."""
    return {f.name: f.default for f in dataclasses.fields(RunConfig) if not f.name.startswith("_")}


def config_key(name: str) -> str:
    """The kebab-case run-config key of a field name."""
    return name.replace("_", "-")


@dataclass(frozen=True)
class RunConfig:
    """Settings of one federated run (defaults: the README's default simulation)."""

    num_server_rounds: int = 20
    preset: str = ""
    dataset: str = "digits"
    task: str = ""
    data_dir: str = ""
    partitioning: str = "dirichlet"
    dirichlet_alpha: float = 0.5
    classes_per_client: int = 2
    test_fraction: float = 0.2
    clients_per_round: int = 0
    min_clients: int = 1
    local_epochs: int = 5
    local_steps: int = 0
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    proximal_mu: float = 0.0
    codec: str = "topk:ratio=0.01|quant:bits=4"
    small_codec: str = "none"
    min_numel: int = 1024
    codec_overrides: str = ""
    uplink_budget: str = ""
    feedback: str = "ef"
    downlink_codec: str = "topk:ratio=0.08|quant:bits=4"
    downlink_codec_overrides: str = ""
    downlink_budget: str = ""
    budget_values: str = "auto"
    budget_worth: str = "energy"
    budget_small_tensors: str = "budgeted"
    wire_header: str = "predicted"
    downlink_history: int = 1000
    downlink_mode: str = "per-client"
    downlink_forget_after: int = 0
    shared_init: bool = True
    server_optimizer: str = "sgd"
    server_lr: float = 1.0
    server_momentum: float = 0.9
    server_beta1: float = 0.9
    server_beta2: float = 0.99
    server_tau: float = 1e-3
    server_lr_schedule: str = "constant"
    server_lr_final: float = 0.0
    server_average: float = 0.0
    save_model_every: int = 0
    round_timeout: float = 600.0
    eval_every: int = 1
    norm_bound: float = 1.5
    norm_action: str = "clip"
    weight_cap: float = 3.0
    aggregation: str = "mean"
    fault_dropout: float = 0.0
    fault_straggler: float = 0.0
    fault_corrupt: float = 0.0
    fault_lie: float = 0.0
    fault_nonfinite: float = 0.0
    fault_poison: float = 0.0
    fault_stale: float = 0.0
    fault_seed: int = 0
    attack: str = "none"
    attack_fraction: float = 0.0
    dp: str = "none"
    dp_noise_multiplier: float = 1.0
    dp_clip_norm: float = 1.0
    dp_delta: float = 1e-5
    dp_target_epsilon: float = 0.0
    dp_adaptive_clip: bool = False
    dp_target_quantile: float = 0.5
    dp_clip_lr: float = 0.2
    dp_clipped_count_stddev: float = 0.0
    dp_accountant: str = "pld"
    dp_reproducible_noise: bool = False
    shared_randk: float = 0.0
    checkpoint: bool = True
    checkpoint_every: int = 1
    resume: bool = False
    seed: int = 0
    run_name: str = ""
    results_dir: str = "results"
    _policies: tuple[CompressionPolicy, CompressionPolicy] = field(
        init=False, repr=False, compare=False)
    _notices: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name.startswith("_"):
                continue
            value = getattr(self, f.name)
            expected = type(f.default)
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, f.name, float(value))
            elif type(value) is not expected:
                raise SpecError(f"run config {config_key(f.name)!r} must be "
                                f"{expected.__name__}, got {value!r}")
        if self.feedback == "ef21":
            raise SpecError("run config 'feedback' = 'ef21' is not supported in a run: the "
                            "server would have to keep each client's EF21 estimate and "
                            "aggregate estimates, and it aggregates updates; use 'ef' or "
                            "'none'")
        if self.task and "." not in self.task and self.task not in _CHOICES["dataset"]:
            raise SpecError(f"run config 'task' must be one of fedcomp's tasks "
                            f"({', '.join(_CHOICES['dataset'])}) or a module path such as "
                            f"'mypackage.task', got {self.task!r}")
        if self.preset and self.preset not in PRESETS:
            raise SpecError(f"run config 'preset' = {self.preset!r} is not a preset; known: "
                            f"{', '.join(PRESETS)}")
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise SpecError(f"run config {config_key(name)!r} must be one of "
                                f"{', '.join(choices)}; got {getattr(self, name)!r}")
        positive = ("num_server_rounds", "batch_size", "classes_per_client", "min_clients",
                    "downlink_history", "eval_every", "checkpoint_every")
        for name in positive:
            if getattr(self, name) < 1:
                raise SpecError(f"run config {config_key(name)!r} must be >= 1, "
                                f"got {getattr(self, name)!r}")
        non_negative = ("local_epochs", "local_steps", "clients_per_round", "min_numel",
                        "downlink_forget_after",
                        "lr", "proximal_mu", "server_lr", "server_lr_final", "dirichlet_alpha")
        for name in non_negative:
            if getattr(self, name) < 0:
                raise SpecError(f"run config {config_key(name)!r} must be >= 0, "
                                f"got {getattr(self, name)!r}")
        if self.local_epochs == 0 and self.local_steps == 0:
            raise SpecError("run config needs local-epochs > 0 or local-steps > 0")
        if not 0.0 < self.test_fraction < 1.0:
            raise SpecError(f"run config 'test-fraction' must be in (0, 1), "
                            f"got {self.test_fraction!r}")
        if self.dirichlet_alpha == 0 and self.partitioning == "dirichlet":
            raise SpecError("run config 'dirichlet-alpha' must be > 0")
        if self.norm_bound != 0 and self.norm_bound < 1:
            raise SpecError(f"run config 'norm-bound' must be 0 (off) or >= 1 (a multiple "
                            f"of the round's median update norm), got {self.norm_bound!r}")
        if self.dp != "none" and (self.dp_noise_multiplier <= 0 or self.dp_clip_norm <= 0
                                  or not 0 < self.dp_delta < 1 or self.dp_target_epsilon < 0):
            raise SpecError("run config dp-noise-multiplier and dp-clip-norm must be > 0, "
                            "dp-delta in (0, 1) and dp-target-epsilon >= 0")
        defaults = _defaults()
        if self.dp == "client" and self.norm_bound not in (0.0, defaults["norm_bound"]):
            raise SpecError("run config 'norm-bound' cannot be set with dp = 'client': its "
                            "median-based rejection lets one client change which others are "
                            "kept, so a client's influence would exceed dp-clip-norm; the "
                            "server's re-clipping to dp-clip-norm bounds every update instead "
                            "(the default bound is not applied under client-level DP)")
        if self.weight_cap != 0 and self.weight_cap < 1:
            raise SpecError(f"run config 'weight-cap' must be 0 (off) or >= 1 (a multiple of "
                            f"the round's median example count), got {self.weight_cap!r}")
        try:
            rule = parse_rule(self.aggregation)
        except SpecError as exc:
            raise SpecError(f"run config 'aggregation': {exc}") from None
        if rule.robust and self.dp == "client":
            raise SpecError(f"run config 'aggregation' = {self.aggregation!r} cannot be used "
                            "with dp = 'client': the noise is calibrated to the sum of "
                            "clipped updates")
        if not 0.0 <= self.shared_randk <= 1.0:
            raise SpecError(f"run config 'shared-randk' must be in [0, 1] (0: off), got "
                            f"{self.shared_randk!r}")
        if self.dp_adaptive_clip and self.dp != "client":
            raise SpecError("run config 'dp-adaptive-clip' needs dp = 'client'")
        if not 0 < self.dp_target_quantile < 1 or self.dp_clip_lr <= 0 \
                or self.dp_clipped_count_stddev < 0:
            raise SpecError("run config dp-target-quantile must be in (0, 1), dp-clip-lr > 0 "
                            "and dp-clipped-count-stddev >= 0 (0: automatic)")
        if self.downlink_codec == "none":
            # Nothing to compress: every message is the full model or the (lossless)
            # updates a client missed, which is the shared mode whatever was asked.
            object.__setattr__(self, "downlink_mode", "shared")
        if not 0.0 <= self.server_average < 1.0:
            raise SpecError(f"run config 'server-average' must be in [0, 1) (0: off), got "
                            f"{self.server_average!r}")
        if self.save_model_every < 0:
            raise SpecError(f"run config 'save-model-every' must be >= 0 (0: off), got "
                            f"{self.save_model_every!r}")
        if self.round_timeout <= 0:
            raise SpecError(f"run config 'round-timeout' must be > 0, got {self.round_timeout!r}")
        try:
            self.fault_plan  # noqa: B018  (validates the fault probabilities)
        except ValueError as exc:
            raise SpecError(f"run config fault-*: {exc}") from None
        try:
            self.attack_plan  # noqa: B018
        except ValueError as exc:
            raise SpecError(f"run config 'attack' / 'attack-fraction': {exc}") from None
        overrides = []
        for name in ("codec_overrides", "downlink_codec_overrides"):
            try:
                overrides.append(parse_overrides(getattr(self, name)))
            except SpecError as exc:
                raise SpecError(f"run config {config_key(name)!r}: {exc}") from None
        budgets = []
        for key in ("uplink-budget", "downlink-budget"):
            try:
                budgets.append(parse_budget(getattr(self, key.replace("-", "_"))))
            except SpecError as exc:
                raise SpecError(f"run config {key!r}: {exc}") from None
        if budgets[0] is not None and (self.dp == "client" or self.shared_randk):
            raise SpecError("run config 'uplink-budget' cannot be combined with dp = "
                            "'client' or 'shared-randk' (they code a transformed update "
                            "whose bytes the budget does not yet allocate)")
        if self.budget_values not in ("auto", "codec"):
            raise SpecError(f"run config 'budget-values' must be 'auto' (each budgeted "
                            f"tensor's value coding chosen from {', '.join(VALUE_CHOICES)}) "
                            f"or 'codec' (the codec's own), got {self.budget_values!r}")
        if self.budget_worth not in WORTH_MEASURES:
            raise SpecError(f"run config 'budget-worth' must be 'energy' (a tensor's kept "
                            f"energy as it is), 'adaptive' (divided by the rms of its "
                            f"fresh update, as an adaptive server optimizer scales its "
                            f"steps), 'relative' (divided by the tensor's squared norm: "
                            f"its relative change) or 'balanced' (the log of the share of "
                            f"its energy kept); it weighs the uplink only; got "
                            f"{self.budget_worth!r}")
        values = VALUE_CHOICES if self.budget_values == "auto" else ()
        policies, notices = [], []
        for (codec_key, codec), budget, pairs in zip(
                (("codec", self.codec), ("downlink-codec", self.downlink_codec)),
                budgets, overrides, strict=True):
            side = "uplink" if codec_key == "codec" else "downlink"
            try:
                policy = CompressionPolicy(
                    codec, self.small_codec, self.min_numel, pairs,
                    budgeted=budget is not None,
                    budget_values=values if budget is not None else (),
                    # The downlink's receiver applies what it gets as it is: energy.
                    budget_worth=self.budget_worth if codec_key == "codec" else "energy",
                    budget_small_fixed=self.budget_small_tensors == "small-codec",
                    wire_header=self.wire_header)
            except SpecError as exc:
                raise SpecError(f"run config {codec_key!r} with '{side}-budget': {exc}"
                                ) from None
            policies.append(policy)
            if policy.budget_sends_fp32_values:
                notices.append(
                    f"run config {codec_key!r} = {codec!r} has no value stage, so with "
                    f"budget-values = 'codec' the {side} budget sends every kept value in "
                    f"fp32; add one (e.g. '{codec}|quant:bits=4') or set budget-values = "
                    f"'auto'")
        object.__setattr__(self, "_policies", tuple(policies))
        object.__setattr__(self, "_notices", tuple(notices))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *,
                     explicit: bool | Collection[str] = False) -> RunConfig:
        """Build from a Flower ``run_config`` (kebab-case keys); unknown keys are errors.

        ``explicit``: the keys the user set, each of which wins over a preset even at
        its default (see :func:`fedcomp.presets.expand`): ``True`` when ``values``
        holds only those (a sweep file), or the keys themselves (a Flower
        ``run_config`` holds every key; its run's override config names the set ones).
        """
        by_key = {config_key(f.name): f.name for f in dataclasses.fields(cls)
                  if not f.name.startswith("_")}
        values = expand_presets(values, {config_key(f.name): f.default
                                         for f in dataclasses.fields(cls)
                                         if not f.name.startswith("_")}, explicit=explicit)
        unknown = sorted(set(values) - set(by_key))
        if unknown:
            raise SpecError(f"unknown run config key(s) {', '.join(map(repr, unknown))}; "
                            f"known keys: {', '.join(sorted(by_key))}")
        return cls(**{by_key[k]: v for k, v in values.items()})

    @classmethod
    def from_recorded(cls, values: Mapping[str, Any]) -> RunConfig:
        """The config of a recorded run (``summary.json``'s ``config``, every key it
        had): a key the record lacks is a setting added after the run, which ran
        with that setting's behaviour from before it existed or changed (the run
        id's baseline), not with today's default.
        """
        return cls.from_mapping({**_DIGEST_BASELINE, **values})

    def to_mapping(self) -> dict[str, Any]:
        """The config as kebab-case keys (what ``--run-config`` takes)."""
        return {config_key(f.name): getattr(self, f.name) for f in dataclasses.fields(self)
                if not f.name.startswith("_")}

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    @property
    def uplink_policy(self) -> CompressionPolicy:
        return self._policies[0]

    @property
    def downlink_policy(self) -> CompressionPolicy:
        return self._policies[1]

    @property
    def notices(self) -> tuple[str, ...]:
        """Settings that are legal but rarely meant, one sentence each: the server
        prints them before round 1 and ``fedcomp sweep`` before its first run."""
        return self._notices

    def uplink_budget_bytes(self, shapes: Mapping[str, Any]) -> int | None:
        """The most payload bytes one update of a model of ``shapes`` may take under
        ``uplink-budget`` (None: no budget)."""
        return _budget_bytes(self.uplink_budget, shapes)

    def downlink_budget_bytes(self, shapes: Mapping[str, Any]) -> int | None:
        """The same for one downlink payload under ``downlink-budget``."""
        return _budget_bytes(self.downlink_budget, shapes)

    def _budgets(self) -> Iterator[tuple[str, ByteBudget, CompressionPolicy]]:
        """(run-config key, budget, policy) of each direction that has a budget."""
        for key, text, policy in (("uplink-budget", self.uplink_budget, self.uplink_policy),
                                  ("downlink-budget", self.downlink_budget,
                                   self.downlink_policy)):
            budget = parse_budget(text)
            if budget is not None:
                yield key, budget, policy

    def check_budgets(self, shapes: Mapping[str, Any]) -> None:
        """Refuse, before round 1, a budget below the smallest payload of this model.

        Raises
        ------
        fedcomp.errors.SpecError
            Naming the budget, the smallest payload and the largest factor that fits.
        """
        numel = sum(math.prod(shape) for shape in shapes.values())
        for key, budget, policy in self._budgets():
            need = smallest_budget_bytes(policy, shapes)
            if budget.payload_bytes(numel) < need:
                fixed = [name for name, shape in shapes.items()
                         if policy.family_for(tuple(shape), name) is None]
                # Fixed by size, not by an override: no override names them.
                small = [name for name in fixed if policy.pipeline_for(tuple(shapes[name]), name)
                         is policy.pipeline_for(tuple(shapes[name]))]
                parts = []
                if len(fixed) > len(small):
                    parts.append(f"{len(fixed) - len(small)} tensors in their override codecs")
                if small:
                    parts.append(f"{len(small)} tensors under min-numel whole in small-codec "
                                 f"{self.small_codec!r}")
                rest = "and " + (" and ".join(parts) if parts else "no other tensor")
                raise SpecError(
                    f"run config {key!r} {budget.describe(numel)} is below the smallest "
                    f"payload of this model: {need:,} bytes (the header, one Top-K entry "
                    f"of one of {len(shapes) - len(fixed)} budgeted tensors {rest}); use "
                    f"at most '{int(4 * numel / need)}x' or at least "
                    f"'{8 * need / numel:.4f}bpp'")

    def budget_notices(self, shapes: Mapping[str, Any]) -> tuple[str, ...]:
        """What a budget that the run accepts will not do for this model: send every
        tensor in each payload.

        Below that size each payload leaves some tensors out, and they move only when
        their error-feedback residuals outgrow the others'. A large model has room to
        spare (Fashion-MNIST's CNN fits every tensor in a ``1000x`` payload); a small
        one with many biases and norms may not, and learns slowly so (the MNIST-1D
        transformer at ``400x``, experiments/RESULTS.md). Call after
        :meth:`check_budgets`.
        """
        notices = []
        numel = sum(math.prod(shape) for shape in shapes.values())
        for key, budget, policy in self._budgets():
            every = every_tensor_payload_bytes(policy, shapes)
            if budget.payload_bytes(numel) >= every:
                continue
            notice = (f"run config {key!r} {budget.describe(numel)} cannot send every "
                      f"tensor in a payload: the model's {len(shapes)} tensors, one Top-K "
                      f"entry of each budgeted one, take {every:,} bytes. Each payload leaves "
                      f"some out until their error-feedback residuals outweigh the "
                      f"others', and a model with many small tensors (biases, norms) "
                      f"learns slowly so. A budget of at most '{int(4 * numel / every)}x' "
                      f"has room for one entry of every tensor")
            small = [name for name, shape in shapes.items()
                     if policy.family_for(tuple(shape), name) is not None
                     and math.prod(shape) < self.min_numel]
            if small and not policy.budget_small_fixed:
                floors = []
                for codec in dict.fromkeys((self.small_codec, "ternary:mode=mean")):
                    fixed = dataclasses.replace(policy, small_codec=codec,
                                                budget_small_fixed=True)
                    need = smallest_budget_bytes(fixed, shapes)
                    floors.append(f"at most '{int(4 * numel / need)}x' in small-codec "
                                  f"{codec!r}")
                notice += (f"; budget-small-tensors = 'small-codec' sends the {len(small)} "
                           f"tensors under min-numel whole in every payload, "
                           f"{' or '.join(floors)}")
            notices.append(notice)
        return tuple(notices)

    @property
    def fault_plan(self) -> FaultPlan:
        """The fault injection plan (inactive unless some ``fault-*`` key is > 0)."""
        return FaultPlan({kind: getattr(self, f"fault_{kind}") for kind in FAULT_KINDS},
                         seed=self.fault_seed)

    @property
    def task_name(self) -> str:
        """The task the run trains: ``task`` if set, else the built-in ``dataset``."""
        return self.task or self.dataset

    @property
    def aggregation_rule(self) -> AggregationRule:
        """The parsed ``aggregation`` rule."""
        return parse_rule(self.aggregation)

    def influence_bounds(self) -> dict[str, float]:
        """The norm bound and weight cap :func:`fedcomp.federated.aggregation.aggregate_deltas`
        applies: none under client-level DP, whose re-clipping bounds every update."""
        if self.dp == "client":
            return {"norm_bound": 0.0, "weight_cap": 0.0}
        return {"norm_bound": self.norm_bound, "weight_cap": self.weight_cap}

    @property
    def attack_plan(self) -> AttackPlan:
        """Which clients attack, and how (for experiments; none by default)."""
        return AttackPlan(self.attack, self.attack_fraction, self.fault_seed)

    def subspace(self, server_round: int) -> RandomSubspace | None:
        """The round's shared random subspace (``shared-randk`` > 0), else None."""
        if not self.shared_randk:
            return None
        return RandomSubspace(self.shared_randk, self.seed, server_round, self.min_numel)

    def uplink_expected(self, shapes: Mapping[str, Any]) -> dict[str, ExpectedTensor]:
        """What the server demands of an uplink payload for a model of ``shapes``.

        With ``shared-randk`` the payload holds each tensor's subspace values (a 1-D
        array) and each still gets the pipeline of its full size.
        """
        subspace = self.subspace(0)
        if subspace is None:
            return self.uplink_policy.expected(shapes)
        return self.uplink_policy.expected(subspace.compact_shapes(shapes), selection=shapes)

    def describe(self) -> dict[str, Any]:
        """The config plus the parsed codec configs (for ``summary.json``)."""
        out = self.to_mapping()
        out["codec-config"] = Pipeline.parse(self.codec).get_config()
        out["small-codec-config"] = Pipeline.parse(self.small_codec).get_config()
        out["downlink-codec-config"] = Pipeline.parse(self.downlink_codec).get_config()
        for key, policy in (("codec-overrides-config", self.uplink_policy),
                            ("downlink-codec-overrides-config", self.downlink_policy)):
            if policy.overrides:
                out[key] = [[pattern, Pipeline.parse(spec).get_config()]
                            for pattern, spec in policy.overrides]
        return out

    def encoder_fingerprint(self, shapes: Mapping[str, Any]) -> str:
        """The uplink and downlink policies' fingerprint on a model of ``shapes``.

        Recorded in ``summary.json`` (``encoder``): the run id covers the config, this
        covers the code that turned it into bytes (see
        :func:`fedcomp.codecs.policy.encoder_fingerprint`).
        """
        return encoder_fingerprint((self.uplink_policy, self.downlink_policy),
                                   {name: tuple(shape) for name, shape in shapes.items()})

    def node_settings(self) -> dict[str, Any]:
        """The run config a node is sent: every key, with the preset's name left out.

        Its settings are already expanded into the keys (by the server, which knows
        which keys the user set); a node that expanded it again could not tell a key
        the user set to its default from one left alone, and would undo it.
        """
        return {key: value for key, value in self.to_mapping().items() if key != "preset"}

    def settings_digest(self) -> str:
        """A hash of every setting a node is sent (outputs included): a train message
        that carries only this stands for the run config a node received in full
        before (:meth:`node_settings`)."""
        blob = json.dumps(self.node_settings(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def digest(self) -> str:
        """A short stable hash of everything that shapes the run's results.

        Only settings that differ from their defaults enter it, so a new setting
        added later (with a default that keeps the old behaviour) leaves the ids of
        completed sweep runs and the checkpoints of old runs valid. Settings that only
        say where and what to write (run name, folder, checkpoint, saved models) or
        whether to resume do not shape results and stay out.
        """
        defaults = {**RunConfig().to_mapping(), **_DIGEST_BASELINE}
        mapping = self.to_mapping()
        if self.dp == "client":
            mapping.update(_CLIENT_DP_ID_BOUNDS)
        settings = {k: v for k, v in mapping.items()
                    if k not in ("preset", "run-name", "results-dir", "resume", "checkpoint",
                                 "checkpoint-every", "save-model-every")
                    and v != defaults[k]}
        blob = json.dumps(settings, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:10]

    @property
    def resolved_run_name(self) -> str:
        return self.run_name or f"{self.task_name.replace('.', '-')}-{self.digest()}"
