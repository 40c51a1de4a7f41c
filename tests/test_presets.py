"""Presets and grouped settings: expanded before the run id, every key still overridable."""

from __future__ import annotations

import pytest

from fedcomp.config import RunConfig
from fedcomp.errors import SpecError
from fedcomp.presets import PRESETS


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_a_valid_run_config_with_the_run_id_of_its_keys(name):
    by_name = RunConfig.from_mapping({"preset": name})
    by_keys = RunConfig.from_mapping(dict(PRESETS[name].settings))
    assert by_name.replace(preset="") == by_keys
    assert by_name.digest() == by_keys.digest()


def test_a_key_set_beside_a_preset_wins_and_defaults_do_not():
    cfg = RunConfig.from_mapping({"preset": "stc", "feedback": "none"})
    assert cfg.feedback == "none" and cfg.codec == PRESETS["stc"].settings["codec"]
    # Flower hands apps every key, defaults included: a default does not undo a preset.
    everything = {**RunConfig().to_mapping(), "preset": "fedavg"}
    assert RunConfig.from_mapping(everything).codec == "none"
    # Expanding twice (server, then client) changes nothing.
    again = RunConfig.from_mapping(cfg.to_mapping())
    assert again == cfg


def test_a_key_the_user_wrote_at_its_default_beside_a_preset_wins():
    """``flwr run --run-config "preset='fedcomp-budget' budget-worth='energy'"``: the
    ServerApp gets every key, but the run's override config names the written ones."""
    from fedcomp.federated.client_round import resolve_settings

    default = RunConfig().budget_worth
    assert PRESETS["fedcomp-budget"].settings["budget-worth"] != default
    everything = {**RunConfig().to_mapping(), "preset": "fedcomp-budget"}
    cfg = RunConfig.from_mapping(everything, explicit={"preset", "budget-worth"})
    assert cfg.budget_worth == default
    assert cfg.budget_values == PRESETS["fedcomp-budget"].settings["budget-values"]
    # Without the override config a key at its default cannot be told from one left
    # alone: the preset's setting applies.
    assert RunConfig.from_mapping(everything).budget_worth != default
    # A node is sent the expanded keys without the preset's name, so it keeps the
    # user's default, in full and by digest.
    assert "preset" not in cfg.node_settings()
    sent = {**cfg.node_settings(), "server-round": 1, "settings-digest": cfg.settings_digest()}
    first = resolve_settings(sent, kept=None, run_config=everything)
    assert first.cfg == cfg.replace(preset="")
    assert first.cfg.settings_digest() == cfg.settings_digest()
    again = resolve_settings({"server-round": 2, "settings-digest": cfg.settings_digest()},
                             kept=first.to_keep, run_config=everything)
    assert again.cfg.budget_worth == default


def test_the_server_reads_the_keys_the_user_set_from_its_run():
    from types import SimpleNamespace

    from server.app import keys_set_by_user

    grid = SimpleNamespace(run=SimpleNamespace(override_config={"preset": "stc",
                                                                "feedback": "ef"}))
    assert keys_set_by_user(grid) == {"preset", "feedback"}

    class NoRunYet:  # Flower's grids before set_run
        @property
        def run(self):
            raise TypeError("vars() argument must have __dict__ attribute")

    assert keys_set_by_user(NoRunYet()) == frozenset()
    assert keys_set_by_user(SimpleNamespace()) == frozenset()


def test_a_sweep_can_set_a_presets_key_back_to_its_default():
    """A sweep file names only the keys it sets, so each wins, its default included
    (an ablation of a preset's setting), and what the apps receive keeps it."""
    from fedcomp.ops.sweep import Sweep

    default = RunConfig().server_average
    assert PRESETS["fedcomp-best"].settings["server-average"] != default
    sweep = Sweep(base={}, grid={"seed": [0]}, num_supernodes=2, methods=[
        {"name": "best", "preset": "fedcomp-best"},
        {"name": "best without averaging", "preset": "fedcomp-best",
         "server-average": default}])
    with_average, without = (run.config for run in sweep.runs)
    assert with_average.server_average == PRESETS["fedcomp-best"].settings["server-average"]
    assert without.server_average == default
    assert without.feedback == PRESETS["fedcomp-best"].settings["feedback"]
    assert with_average.digest() != without.digest()
    # The runner hands the apps the expanded keys without the preset: Flower's
    # run_config holds every key, and the apps' expansion leaves the default alone.
    handed = {**without.replace(preset="").to_mapping()}
    assert RunConfig.from_mapping(handed) == without.replace(preset="")
    # With the preset still named, the apps could not tell the default from a key
    # left alone, and would undo the ablation.
    assert RunConfig.from_mapping(without.to_mapping()).server_average != default


def test_the_sweep_runner_hands_flower_the_expanded_config_without_its_preset(
        tmp_path, monkeypatch):
    import tomllib

    from fedcomp.ops import cli

    handed = {}

    def fake_run(project, connection, run_config, **kwargs):
        handed.update(tomllib.loads(open(run_config).read()))
        return 1, "finished:failed", None, []

    monkeypatch.setattr(cli, "_flower_run", fake_run)
    config = RunConfig.from_mapping({"preset": "fedcomp-best", "server-average": 0.0,
                                     "results-dir": str(tmp_path)}, explicit=True)
    with pytest.raises(RuntimeError, match="finished:failed"):
        cli.flower_runner(tmp_path)(config, 2)
    assert handed["preset"] == "" and handed["server-average"] == 0.0
    assert handed["feedback"] == PRESETS["fedcomp-best"].settings["feedback"]


def test_an_unknown_preset_names_the_known_ones():
    with pytest.raises(SpecError, match=r"'preset' = 'sct'.*stc"):
        RunConfig.from_mapping({"preset": "sct"})


def test_the_server_optimizer_takes_a_spec_string():
    cfg = RunConfig.from_mapping({"server-optimizer": "adam:lr=0.01,tau=1e-5,beta2=0.999"})
    assert (cfg.server_optimizer, cfg.server_lr, cfg.server_tau, cfg.server_beta2) == (
        "adam", 0.01, 1e-5, 0.999)
    assert cfg.digest() == RunConfig.from_mapping(
        {"server-optimizer": "adam", "server-lr": 0.01, "server-tau": 1e-5,
         "server-beta2": 0.999}).digest()
    with pytest.raises(SpecError, match="'server-lr' is given twice"):
        RunConfig.from_mapping({"server-optimizer": "adam:lr=0.01", "server-lr": 0.1})
    with pytest.raises(SpecError, match="no parameter 'rho'"):
        RunConfig.from_mapping({"server-optimizer": "adam:rho=0.1"})


def test_fedcomp_presets_lists_every_preset_with_its_keys(capsys):
    from fedcomp.ops.cli import main

    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert all(f"{name}: " in out for name in PRESETS) and "server-tau = 1e-05" in out
