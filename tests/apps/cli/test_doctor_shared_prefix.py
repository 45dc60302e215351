"""MEGATRON_RL_PATCHES_SHARED_PREFIX in `doctor`: whether shared-prefix packing is on and where, a
problem when slime_fused (the route it takes effect through) is not selected; a value that is no
switch refused by name by `check_settings`, the launcher and doctor alike."""
from __future__ import annotations

import json

import pytest

from megatron_rl_patches.apps import cli
from megatron_rl_patches.integrations import check_settings
from megatron_rl_patches.patching.startup.launcher import launch_environment

VARIABLE = "MEGATRON_RL_PATCHES_SHARED_PREFIX"


def _doctor(capsys, monkeypatch, **variables):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    cli.main(["doctor", "--json"])
    report = json.loads(capsys.readouterr().out)
    cli.main(["doctor"])
    return report, capsys.readouterr().out


@pytest.mark.parametrize(("value", "words"), [("1", "shared prefix: on: slime's passes"),
                                              ("0", f"shared prefix: off ({VARIABLE} unset or 0)")])
def test_doctor_says_whether_it_is_on(capsys, clean_patch_state, value, words):
    report, text = _doctor(capsys, clean_patch_state, **{VARIABLE: value, "MEGATRON_RL_PATCHES": "all"})
    assert words in text
    assert report["environment"]["shared_prefix"] is (value == "1")
    assert not [p for p in report["problems"] if VARIABLE in p]


def test_doctor_names_the_route_it_needs(capsys, clean_patch_state):
    report, _ = _doctor(capsys, clean_patch_state, **{VARIABLE: "1", "MEGATRON_RL_PATCHES": "ddp_hooks"})
    assert any(f"{VARIABLE}=1 takes effect through patch slime_fused" in p for p in report["problems"])


def test_a_value_that_is_no_switch_is_refused_everywhere(capsys, clean_patch_state):
    refusal = rf"{VARIABLE}='maybe' is not a switch: use 1"
    with pytest.raises(ValueError, match=refusal):
        check_settings({VARIABLE: "maybe"})
    with pytest.raises(ValueError, match=refusal):
        launch_environment(None, {VARIABLE: "maybe"})
    report, text = _doctor(capsys, clean_patch_state, **{VARIABLE: "maybe"})
    assert "shared prefix: unreadable" in text and any("is not a switch" in p for p in report["problems"])
