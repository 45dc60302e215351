"""MEGATRON_RL_PATCHES_SHARED_PREFIX in `doctor`: whether shared-prefix packing is on, the value as it was
set, and one verdict per framework door (slime's slime_fused, verl's verl_fused_logprobs, NeMo-RL's
nemo_rl_shared_prefix) from the patch selection alone, on any machine (issue 119 item 4: a NeMo-RL or
verl selection was told "patch slime_fused ... is not selected", slime's alone was told NeMo-RL's and
verl's passes share, and verl's door counted only where verl imports); a problem naming the variables
at cause when no door's patch will apply (MEGATRON_RL_PATCHES unset or off, MEGATRON_RL_PATCHES_DISABLE
naming them, a list without them: issue 110 item 7); a value that is no switch refused by name, listing
every word a switch takes, by `check_settings`, the launcher and doctor alike."""
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


@pytest.mark.parametrize(("value", "words"), [("1", "slime: shares (training step"),
                                              (" Yes", "slime: shares (training step"),
                                              ("0", f"shared prefix: off ({VARIABLE}='0')"),
                                              ("off", f"shared prefix: off ({VARIABLE}='off')"),
                                              ("", f"shared prefix: off ({VARIABLE}='')")])
def test_doctor_says_whether_it_is_on(capsys, clean_patch_state, value, words):
    report, text = _doctor(capsys, clean_patch_state, **{VARIABLE: value, "MEGATRON_RL_PATCHES": "all"})
    assert words in text
    assert report["environment"]["shared_prefix"] is ("shares" in words)
    assert not [p for p in report["problems"] if VARIABLE in p]


def test_unset_it_says_unset(capsys, clean_patch_state):
    _, text = _doctor(capsys, clean_patch_state, MEGATRON_RL_PATCHES="all")
    assert "shared prefix: off (unset)" in text


def _route_problem(report):
    (problem,) = [p for p in report["problems"] if VARIABLE in p]
    assert (f"{VARIABLE}='1' takes effect through a framework's patch (slime_fused, verl_fused_logprobs, "
            "nemo_rl_shared_prefix), none of which will apply") in problem
    return problem


def _doors(report) -> dict:
    return {key: door["selected"] for key, door in report["environment"]["shared_prefix_doors"].items()}


def test_doctor_names_the_patches_it_needs(capsys, clean_patch_state):
    report, text = _doctor(capsys, clean_patch_state, **{VARIABLE: "1", "MEGATRON_RL_PATCHES": "ddp_hooks"})
    problem = _route_problem(report)
    assert "MEGATRON_RL_PATCHES='ddp_hooks' selects ddp_hooks" in problem
    assert "add slime_fused to MEGATRON_RL_PATCHES, or set MEGATRON_RL_PATCHES=all" in problem
    assert "add nemo_rl_shared_prefix to MEGATRON_RL_PATCHES" in problem
    assert _doors(report) == {"slime": False, "verl": False, "nemo-rl": False}
    assert "shares (" not in text


@pytest.mark.parametrize(("select", "door"), [("nemo_rl_shared_prefix", "nemo-rl"), ("verl_fused_logprobs", "verl"),
                                             ("slime_fused", "slime")])
def test_each_frameworks_door_alone_is_on_on_any_machine(capsys, clean_patch_state, select, door):
    """Issue 119 item 4 (each case failed on 9e804589): the one framework's patch selected shares its passes
    and no problem is reported, whether or not the framework is importable here (verl is not, in this lane);
    the others say their patch is not selected, in their own line."""
    report, text = _doctor(capsys, clean_patch_state, **{VARIABLE: "1", "MEGATRON_RL_PATCHES": select})
    assert not [p for p in report["problems"] if VARIABLE in p], report["problems"]
    assert _doors(report) == {key: key == door for key in ("slime", "verl", "nemo-rl")}
    verdicts = report["environment"]["shared_prefix_doors"]
    assert verdicts[door]["verdict"].startswith("shares (")
    for other in {"slime", "verl", "nemo-rl"} - {door}:
        assert verdicts[other]["verdict"].startswith(f"packs whole: patch {verdicts[other]['patch']} is not selected")
    assert "asked" not in text and f"{verdicts[door]['title']}: shares (" in text


def test_under_strict_a_door_says_a_pass_that_cannot_share_raises(capsys, clean_patch_state):
    report, _ = _doctor(capsys, clean_patch_state, **{VARIABLE: "1", "MEGATRON_RL_PATCHES": "all",
                                                      "MEGATRON_RL_PATCHES_STRICT": "1"})
    for door in report["environment"]["shared_prefix_doors"].values():
        assert "raises a ValueError on every rank (MEGATRON_RL_PATCHES_STRICT=1)" in door["verdict"]


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
    assert "shares (" not in text and "no problems found" not in text


def test_disabled_names_the_disable_entry(capsys, clean_patch_state):
    """Issue 110 item 7: with MEGATRON_RL_PATCHES=all and the DISABLE entry, doctor advised "set
    MEGATRON_RL_PATCHES=all" and never named DISABLE."""
    report, _ = _doctor(capsys, clean_patch_state, **{
        VARIABLE: "1", "MEGATRON_RL_PATCHES": "all",
        "MEGATRON_RL_PATCHES_DISABLE": "ddp_hooks,slime_fused,verl_fused_logprobs,nemo_rl_shared_prefix"})
    problem = _route_problem(report)
    assert "MEGATRON_RL_PATCHES_DISABLE='ddp_hooks,slime_fused," in problem and "leaves it out" in problem
    for patch in ("slime_fused", "verl_fused_logprobs", "nemo_rl_shared_prefix"):
        assert f"remove {patch} from MEGATRON_RL_PATCHES_DISABLE" in problem
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
