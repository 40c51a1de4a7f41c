"""Run configuration: pyproject defaults, validation naming the bad key."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from fedcomp.config import RunConfig
from fedcomp.errors import SpecError

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_defaults_are_the_run_config_defaults():
    app_config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert RunConfig.from_mapping(app_config["config"]) == RunConfig()
    assert app_config["components"] == {"serverapp": "server.app:app",
                                        "clientapp": "clients.app:app"}


def test_round_trip_through_kebab_case_keys():
    cfg = RunConfig(codec="sign", local_steps=7, server_lr=0.5)
    assert RunConfig.from_mapping(cfg.to_mapping()) == cfg
    assert cfg.to_mapping()["local-steps"] == 7


@pytest.mark.parametrize(
    ("values", "fragment"),
    [
        ({"local-epoch": 3}, "unknown run config key(s) 'local-epoch'"),
        ({"num-server-rounds": "3"}, "'num-server-rounds' must be int"),
        ({"dataset": "cifar"}, "'dataset' must be one of digits, fashion-mnist"),
        ({"codec": "topk:ratio=3"}, "ratio must be <= 1.0"),
        ({"local-epochs": 0, "local-steps": 0}, "local-epochs > 0 or local-steps > 0"),
        ({"server-optimizer": "adagrad"}, "'server-optimizer' must be one of"),
        ({"batch-size": 0}, "'batch-size' must be >= 1"),
        ({"feedback": "ef21"}, "'ef21' is not supported in a run"),
        ({"server-average": 1.0}, "'server-average' must be in"),
        ({"save-model-every": -1}, "'save-model-every' must be >= 0"),
    ],
)
def test_bad_values_are_refused_with_the_key_named(values, fragment):
    with pytest.raises(SpecError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        RunConfig.from_mapping(values)


def test_integers_are_accepted_for_float_keys_and_the_digest_ignores_output_paths():
    assert RunConfig.from_mapping({"lr": 1}).lr == 1.0
    a = RunConfig(results_dir="a", run_name="x")
    assert a.digest() == RunConfig(results_dir="b").digest()
    assert a.digest() != RunConfig(seed=1).digest()
    # Only non-default settings count, so adding a setting later keeps old ids valid.
    import hashlib
    import json
    expected = hashlib.sha256(json.dumps({"seed": 1}).encode()).hexdigest()[:10]
    # Defaults that changed later (the influence bounds, the compressed downlink, the
    # predicted header) are compared with their old values: a run with the old
    # behaviour keeps its old id, one with the new gets a new.
    legacy = RunConfig(seed=1, results_dir="x", norm_bound=0.0, norm_action="reject",
                       weight_cap=0.0, downlink_codec="none", wire_header="json")
    assert legacy.digest() == expected
    assert RunConfig(seed=1).digest() != expected
    assert legacy.replace(wire_header="predicted").digest() != expected
    assert RunConfig(seed=1, norm_bound=0.0, norm_action="reject", weight_cap=0.0,
                     downlink_codec="none", downlink_mode="per-client",
                     wire_header="json").digest() == expected
    assert RunConfig().resolved_run_name.startswith("digits-")
    # A recorded run's config lacks the settings added after it: it ran with their
    # behaviour from before, which the baseline holds, not with today's defaults.
    old_record = {k: v for k, v in legacy.to_mapping().items()
                  if k not in ("wire-header", "downlink-mode")}
    assert RunConfig.from_recorded(old_record).digest() == expected
    assert RunConfig.from_recorded(old_record).wire_header == "json"
    assert RunConfig.from_recorded(RunConfig().to_mapping()) == RunConfig()


def test_bounds_that_client_level_dp_does_not_apply_leave_its_run_id_alone():
    from fedcomp.config import RunConfig

    dp = RunConfig(dp="client")
    assert dp.influence_bounds() == {"norm_bound": 0.0, "weight_cap": 0.0}
    # Whether the (unused) bound is left at its default or turned off: one run, one id.
    assert dp.digest() == RunConfig(dp="client", norm_bound=0.0, weight_cap=0.0).digest()
    # Without client-level DP the bound shapes the run, and the id tells them apart.
    assert RunConfig().digest() != RunConfig(norm_bound=3.0).digest()
