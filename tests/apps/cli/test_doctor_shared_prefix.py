"""MEGATRON_RL_PATCHES_SHARED_PREFIX in `doctor`: whether shared-prefix packing is on and where, the value
as it was set, a problem naming the variable at cause when slime_fused (the route it takes effect
through) will not apply (MEGATRON_RL_PATCHES unset or off, MEGATRON_RL_PATCHES_DISABLE naming it, a list
without it: issue 110 item 7); a value that is no switch refused by name, listing every word a switch
takes, by `check_settings`, the launcher and doctor alike."""
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
                                              (" Yes", "shared prefix: on: slime's passes"),
                                              ("0", f"shared prefix: off ({VARIABLE}='0')"),
                                              ("off", f"shared prefix: off ({VARIABLE}='off')"),
                                              ("", f"shared prefix: off ({VARIABLE}='')")])
def test_doctor_says_whether_it_is_on(capsys, clean_patch_state, value, words):
    report, text = _doctor(capsys, clean_patch_state, **{VARIABLE: value, "MEGATRON_RL_PATCHES": "all"})
    assert words in text
    assert report["environment"]["shared_prefix"] is ("on" in words)
    assert not [p for p in report["problems"] if VARIABLE in p]


def test_unset_it_says_unset(capsys, clean_patch_state):
    _, text = _doctor(capsys, clean_patch_state, MEGATRON_RL_PATCHES="all")
    assert "shared prefix: off (unset)" in text


def _route_problem(report):
    (problem,) = [p for p in report["problems"] if VARIABLE in p]
    assert f"{VARIABLE}='1' takes effect through patch slime_fused, which will not apply" in problem
    return problem


def test_doctor_names_the_route_it_needs(capsys, clean_patch_state):
    report, text = _doctor(capsys, clean_patch_state, **{VARIABLE: "1", "MEGATRON_RL_PATCHES": "ddp_hooks"})
    problem = _route_problem(report)
    assert "MEGATRON_RL_PATCHES='ddp_hooks' selects ddp_hooks" in problem
    assert "add slime_fused to MEGATRON_RL_PATCHES, or set MEGATRON_RL_PATCHES=all" in problem
    assert "shared prefix: asked" in text and "slime's passes" not in text


@pytest.mark.parametrize("verl_found", [True, False])
def test_verls_route_alone_is_on_where_verl_is(capsys, clean_patch_state, verl_found):
    """verl's passes take it through verl_fused_logprobs: selected without slime_fused, it is on
    where verl's Megatron engine is importable (this lane has no verl: the module reported found or
    not), and the slime route's problem otherwise."""
    from megatron_rl_patches.apps.cli import doctor

    real = doctor.importlib.util.find_spec
    clean_patch_state.setattr(doctor.importlib.util, "find_spec", lambda name, *rest: (
        object() if verl_found and name == doctor.VERL_ENGINE else real(name, *rest)))
    report, text = _doctor(capsys, clean_patch_state, **{VARIABLE: "1", "MEGATRON_RL_PATCHES": "verl_fused_logprobs"})
    assert ("shared prefix: on:" in text and "verl's engine passes" in text) is verl_found
    assert bool([p for p in report["problems"] if VARIABLE in p]) is not verl_found


@pytest.mark.parametrize("select", [None, "0", "off"])
def test_patches_off_is_a_problem_not_on(capsys, clean_patch_state, select):
    """Issue 110 item 7: with MEGATRON_RL_PATCHES unset or 0 doctor said "on ... through patch
    slime_fused" and "no problems found", though the job does not share."""
    variables = {VARIABLE: "1"} if select is None else {VARIABLE: "1", "MEGATRON_RL_PATCHES": select}
    report, text = _doctor(capsys, clean_patch_state, **variables)
    problem = _route_problem(report)
    state = "unset" if select is None else f"off (MEGATRON_RL_PATCHES={select!r})"
    assert f"MEGATRON_RL_PATCHES is {state}: nothing applies at start-up" in problem
    assert "set MEGATRON_RL_PATCHES=all (or a list with slime_fused)" in problem and "run -- COMMAND" in problem
    assert "shared prefix: asked" in text and "through patch slime_fused;" not in text
    assert "no problems found" not in text


def test_disabled_names_the_disable_entry(capsys, clean_patch_state):
    """Issue 110 item 7: with MEGATRON_RL_PATCHES=all and the DISABLE entry, doctor advised "set
    MEGATRON_RL_PATCHES=all" and never named DISABLE."""
    report, _ = _doctor(capsys, clean_patch_state, **{VARIABLE: "1", "MEGATRON_RL_PATCHES": "all",
                                                      "MEGATRON_RL_PATCHES_DISABLE": "ddp_hooks,slime_fused"})
    problem = _route_problem(report)
    assert "MEGATRON_RL_PATCHES_DISABLE='ddp_hooks,slime_fused' leaves it out" in problem
    assert problem.endswith("remove slime_fused from MEGATRON_RL_PATCHES_DISABLE")
    assert "set MEGATRON_RL_PATCHES=all" not in problem


def test_top_k_opd_disabled_names_the_disable_entry(capsys, clean_patch_state):
    report, _ = _doctor(capsys, clean_patch_state, **{"MEGATRON_RL_PATCHES_OPD_K": "8", "MEGATRON_RL_PATCHES": "all",
                                                      "MEGATRON_RL_PATCHES_DISABLE": "slime_opd"})
    (problem,) = [p for p in report["problems"] if "slime_opd is not selected" in p]
    assert "MEGATRON_RL_PATCHES_DISABLE='slime_opd' leaves it out" in problem
    assert problem.endswith("remove slime_opd from MEGATRON_RL_PATCHES_DISABLE")


def test_a_value_that_is_no_switch_is_refused_everywhere(capsys, clean_patch_state):
    refusal = (rf"{VARIABLE}='maybe' is not a switch: use 1/true/yes/on \(pack by shared prefix\) or "
               r"0/false/no/off \(each sample whole\), or leave it unset")
    with pytest.raises(ValueError, match=refusal):
        check_settings({VARIABLE: "maybe"})
    with pytest.raises(ValueError, match=refusal):
        launch_environment(None, {VARIABLE: "maybe"})
    report, text = _doctor(capsys, clean_patch_state, **{VARIABLE: "maybe"})
    assert "shared prefix: unreadable" in text and any("is not a switch" in p for p in report["problems"])
