"""bench/__main__.py: the command line (no app, no engines)."""

from __future__ import annotations

import pytest

from bench.__main__ import parser
from bench.profiles import PROFILES, Mode, app_args_of, check_profile


def test_unknown_profile_is_rejected_by_the_cli():
    with pytest.raises(SystemExit):
        parser().parse_args(["sweep", "--profile", "nope"])
    args = parser().parse_args(["sweep", "--profile", "cpu-quick", "--mode", "push", "--mode", "pull"])
    assert args.mode == ["push", "pull"]


@pytest.mark.parametrize("item, expected", [
    ("push=docs/results/kv-checksum/local-cpu-checksums-off.yaml", None),
    ("push", "MODE=PATH"),
    ("decode=configs/local-cpu.yaml", "MODE=PATH"),
])
def test_sweep_runs_a_mode_with_another_config_when_told(item, expected):
    """An A/B of one setting: the profile's points, one mode's config swapped, checked like the profile's own."""
    from bench.__main__ import _mode_config

    if expected:
        with pytest.raises(SystemExit, match=expected):
            _mode_config(item)
        return
    profile = PROFILES["cpu-quick"].with_configs(dict([_mode_config(item)]))
    assert profile.configs[Mode.PUSH] == item.split("=", 1)[1]
    assert profile.configs[Mode.PULL] == PROFILES["cpu-quick"].configs[Mode.PULL]
    assert profile.points() == PROFILES["cpu-quick"].points()
    assert app_args_of(check_profile(profile, [Mode.PUSH])[Mode.PUSH]).handoff.kv_checksums is False


def test_progressive_push_on_and_off_on_the_unshaped_quick_profile():
    """``--config push-progressive=configs/local-cpu.yaml --set engine_kwargs.max_num_batched_tokens=512``: the same
    chunks in both modes, progressive on in one (docs/benchmarks.md)."""
    from bench.__main__ import _mode_config, _overrides

    args = parser().parse_args(["sweep", "--profile", "cpu-quick", "--mode", "push", "--mode", "push-progressive",
                                "--config", "push-progressive=configs/local-cpu.yaml",
                                "--set", "engine_kwargs.max_num_batched_tokens=512", "--set", "handoff.kv_checksums=true"])
    profile = PROFILES["cpu-quick"].with_configs(dict(_mode_config(i) for i in args.config)).with_overrides(_overrides(args.set))
    modes = [Mode(m) for m in args.mode]
    got = {m: app_args_of(c) for m, c in check_profile(profile, modes).items()}
    assert {m: (a.engine_kwargs["max_num_batched_tokens"], a.handoff.progressive) for m, a in got.items()} == {
        Mode.PUSH: (512, False), Mode.PUSH_PROGRESSIVE: (512, True)}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        _overrides(["engine_kwargs.max_num_batched_tokens"])
