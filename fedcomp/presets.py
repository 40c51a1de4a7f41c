"""Named presets: a method is one name, not a dozen run-config keys.

``preset = "stc"`` in a run config (``--run-config``, ``make run RUN_CONFIG=...``, a
sweep's ``[base]`` or ``[[method]]``, a deployment) stands for the settings listed
here. Any key set alongside it wins over the preset's, even one set to its default,
so every setting stays overridable. Presets are expanded before the run id is
computed, so a sweep written with a preset and one written with its keys give the
same runs.

Grouped settings read better as one spec string, as codecs do:
``server-optimizer = "adam:lr=0.01,tau=1e-5"`` stands for ``server-optimizer = "adam"``,
``server-lr = 0.01``, ``server-tau = 1e-5`` (parameters ``lr``, ``momentum``, ``beta1``,
``beta2``, ``tau``, ``schedule``, ``lr-final``).

``fedcomp presets`` lists them with their keys.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from fedcomp.codecs.spec import parse_spec
from fedcomp.errors import SpecError

__all__ = ["PRESETS", "Preset", "expand"]


@dataclass(frozen=True)
class Preset:
    """A named group of run-config settings."""

    description: str
    settings: Mapping[str, Any]


#: What the byte-budget presets share: fedcomp-best's server, a budget each way.
_BUDGET = {"uplink-budget": "400x", "feedback": "ef", "downlink-budget": "40x",
           "downlink-mode": "per-client", "server-optimizer": "adam", "server-lr": 0.01,
           "server-tau": 1e-5, "server-average": 0.9}

#: The uplink methods of the literature, as they are benchmarked: the server sends the
#: whole model down every round (fedcomp's default compresses the downlink too).
_FULL_DOWNLINK = {"downlink-codec": "none"}
_STC = "topk:ratio=0.001|ternary:mode=mean"
_PER_LAYER = "conv2.weight={spec}; fc2.weight={spec}"

#: Every preset by name.
PRESETS: dict[str, Preset] = {
    "fedavg": Preset("FedAvg: the fp32 model delta, no error feedback",
                     {"codec": "none", "feedback": "none", **_FULL_DOWNLINK}),
    "fedavg-average": Preset(
        "FedAvg with an exponential moving average (0.9) of the server's models evaluated",
        {"codec": "none", "feedback": "none", "server-average": 0.9, **_FULL_DOWNLINK}),
    "fedadam": Preset("FedAdam (server lr 0.01) on the fp32 delta",
                      {"codec": "none", "feedback": "none", "server-optimizer": "adam",
                       "server-lr": 0.01, **_FULL_DOWNLINK}),
    "fp16": Preset("half precision, no error feedback",
                   {"codec": "fp16", "feedback": "none", **_FULL_DOWNLINK}),
    "8bit": Preset("8-bit uniform quantization (TFF's default), no error feedback",
                   {"codec": "quant:bits=8", "feedback": "none", **_FULL_DOWNLINK}),
    "qsgd": Preset("QSGD with 16 levels, no error feedback",
                   {"codec": "qsgd:levels=16", "feedback": "none", **_FULL_DOWNLINK}),
    "ef-signsgd": Preset("signSGD with error feedback",
                         {"codec": "sign", "feedback": "ef", **_FULL_DOWNLINK}),
    "stc": Preset("Sparse Ternary Compression: Top-0.1% ternary with error feedback, both "
                  "directions", {"codec": _STC, "feedback": "ef", "downlink-codec": _STC,
                                  "downlink-mode": "shared"}),
    "randk-ef": Preset("Random-1% with error feedback",
                       {"codec": "randk:ratio=0.01", "feedback": "ef", **_FULL_DOWNLINK}),
    "lowrank-ef": Preset("rank-4 PowerSGD-style low-rank with error feedback",
                         {"codec": "lowrank:rank=4|fp16", "feedback": "ef", **_FULL_DOWNLINK}),
    "top1-4bit-ef": Preset("Top-1% + 4-bit + error feedback, the full model down",
                           {"codec": "topk:ratio=0.01|quant:bits=4", "feedback": "ef",
                            **_FULL_DOWNLINK}),
    "fedcomp-best": Preset(
        "the best fedcomp configuration on non-IID Fashion-MNIST: Top-0.5% ternary + EF "
        "(conv2/fc2 Top-10%), 8-bit small tensors, FedAdam (tau 1e-5), a per-client Top-8% "
        "4-bit downlink (conv2/fc2 Top-15%), an average of the server's models",
        {"codec": "topk:ratio=0.005|ternary:mode=mean",
         "codec-overrides": _PER_LAYER.format(spec="topk:ratio=0.1|ternary:mode=mean"),
         "small-codec": "quant:bits=8", "feedback": "ef",
         "downlink-codec": "topk:ratio=0.08|quant:bits=4",
         "downlink-codec-overrides": _PER_LAYER.format(spec="topk:ratio=0.15|quant:bits=4"),
         "downlink-mode": "per-client", "server-optimizer": "adam", "server-lr": 0.01,
         "server-tau": 1e-5, "server-average": 0.9}),
    "fedcomp-budget": Preset(
        "fedcomp-best's server with one byte budget each way instead of its per-layer "
        "codecs: 400x fewer uplink and 40x fewer downlink bytes than fp32, each "
        "tensor's Top-K count chosen every round by its relative change, for any "
        "model; uplink values in one sign bit and a scale, downlink values in 4 bits",
        {**_BUDGET, "codec": "topk|ternary:mode=mean", "downlink-codec": "topk|quant:bits=4",
         "budget-values": "codec", "budget-worth": "relative"}),
    "fedcomp-budget-auto": Preset(
        "fedcomp-budget with each tensor's value coding chosen too (ternary, 2, 4 or "
        "8 bits) and its kept energy counted as it is",
        {**_BUDGET, "codec": "topk", "downlink-codec": "topk"}),
}

#: ``server-optimizer`` spec parameters and the keys they stand for.
_OPTIMIZER_PARAMS = {"lr": "server-lr", "momentum": "server-momentum",
                     "beta1": "server-beta1", "beta2": "server-beta2", "tau": "server-tau",
                     "schedule": "server-lr-schedule", "lr_final": "server-lr-final"}


def _optimizer_spec(spec: str) -> dict[str, Any]:
    """``"adam:lr=0.01,tau=1e-5"`` as run-config keys."""
    try:
        (config,) = parse_spec(spec.replace("lr-final", "lr_final"))
    except (SpecError, ValueError) as exc:
        raise SpecError(f"run config 'server-optimizer' {spec!r}: {exc}") from None
    params = dict(config)
    out: dict[str, Any] = {"server-optimizer": params.pop("id")}
    for key, value in params.items():
        if key not in _OPTIMIZER_PARAMS:
            raise SpecError(f"run config 'server-optimizer' has no parameter {key!r}; known: "
                            f"{', '.join(sorted(_OPTIMIZER_PARAMS))}")
        out[_OPTIMIZER_PARAMS[key]] = value
    return out


def expand(values: Mapping[str, Any], defaults: Mapping[str, Any], *,
           explicit: bool | Collection[str] = False) -> dict[str, Any]:
    """Run-config ``values`` with ``preset`` and a ``server-optimizer`` spec expanded.

    A preset's setting applies where ``values`` leaves the key out, or holds it at its
    default without the user having set it: Flower hands a ClientApp or ServerApp
    every key, defaults included, so a key at its default may be one the user never
    wrote. ``explicit`` names the keys the user did write, which win over the preset
    even at their default (an ablation of a preset's setting): ``True`` for every key
    of ``values`` (a sweep file names only the keys it sets), or a collection of keys
    (what ``flwr run --run-config`` set, which the ServerApp reads from its run). A
    key given both inside a ``server-optimizer`` spec and on its own (written, or not
    at its default) is refused as ambiguous.

    Raises
    ------
    fedcomp.errors.SpecError
        For an unknown preset (naming the known ones) or a bad optimizer spec.
    """
    given = set(values) if explicit is True else set(explicit or ())
    out = dict(values)
    name = out.get("preset", "")
    if name:
        if not isinstance(name, str) or name not in PRESETS:
            raise SpecError(f"run config 'preset' = {name!r} is not a preset; known: "
                            f"{', '.join(PRESETS)} (`fedcomp presets` lists their keys)")
        for key, value in PRESETS[name].settings.items():
            if key not in values or (key not in given and values[key] == defaults.get(key)):
                out[key] = value
    optimizer = out.get("server-optimizer")
    if isinstance(optimizer, str) and ":" in optimizer:
        grouped = _optimizer_spec(optimizer)
        for key, value in grouped.items():
            if key != "server-optimizer" and key in values and (
                    key in given or values[key] != defaults.get(key)) and values[key] != value:
                raise SpecError(f"run config {key!r} is given twice: {values[key]!r} on its "
                                f"own and {value!r} in 'server-optimizer'")
        out.update(grouped)
    return out


def describe() -> str:
    """The presets and their keys, for ``fedcomp presets``."""
    lines = []
    for name, preset in PRESETS.items():
        lines.append(f"{name}: {preset.description}")
        lines += [f"    {key} = {value!r}" for key, value in preset.settings.items()]
    return "\n".join(lines)
