"""Values of the environment variables that are not what they should be: unknown yes/no words,
non-string values in an `environ=` mapping, huge selections."""
from __future__ import annotations

import json

import pytest

import megatron_rl_patches
from megatron_rl_patches.patching import env, records
from megatron_rl_patches.patching.registry import Registry


@pytest.mark.parametrize("value, meaning", [("1", True), (" TRUE ", True), ("yes", True), ("On", True),
                                            ("0", False), ("false", False), ("NO", False), ("off", False),
                                            ("", False), ("  ", False)])
def test_yes_no_words(value, meaning):
    assert env.is_strict({env.STRICT: value}) is meaning
    assert env.allows_untested({env.ALLOW_UNTESTED: value}) is meaning
    assert env.is_strict({}) is False and env.allows_untested({}) is False


@pytest.mark.parametrize("value", ["2", "maybe", "all", "none", "-1", "y"])
def test_unknown_strict_values_raise_listing_the_accepted_ones(value):
    with pytest.raises(ValueError, match=r"MEGATRON_RL_PATCHES_STRICT=.* is not a switch: use 1/true/yes/on \(.*\) or "
                                         r"0/false/no/off \(.*\), or leave it unset"):
        env.is_strict({env.STRICT: value})


def test_apply_with_an_unknown_strict_value_raises_and_changes_nothing():
    reg = Registry([records.Patch("stand_in", "json:dumps", lambda w, i, a, k: "patched", "test", requires=None)])
    before = [s.as_dict() for s in reg.applied()]
    with pytest.raises(ValueError, match="MEGATRON_RL_PATCHES_STRICT='maybe'"):
        reg.apply(environ={env.STRICT: "maybe"})
    assert [s.as_dict() for s in reg.applied()] == before and json.dumps(1) == "1"
    assert reg.apply(environ={env.STRICT: "maybe"}, strict=False)[0].status == "applied"  # the argument wins
    reg.reset()


@pytest.mark.parametrize("variable", [env.SELECT, env.DISABLE, env.STRICT, env.ALLOW_UNTESTED])
def test_a_non_string_value_is_a_type_error_naming_the_variable(clean_patch_state, variable):
    environ = {env.SELECT: "all", variable: 5}
    with pytest.raises(TypeError, match=f"environ\\['{variable}'\\] must be a string"):
        megatron_rl_patches.apply(environ=environ)
    assert {s.status for s in megatron_rl_patches.applied()} == {"skipped"}


def test_environ_must_be_a_mapping(clean_patch_state):
    with pytest.raises(TypeError, match="environ must be a mapping"):
        megatron_rl_patches.apply(environ=[("MEGATRON_RL_PATCHES", "all")])


def test_inference_roles_value_must_be_a_string():
    with pytest.raises(TypeError, match="MEGATRON_RL_PATCHES_INFERENCE_ROLES"):
        env.role_names({env.INFERENCE_ROLES: ["teacher"]})


@pytest.mark.parametrize("value", ["x" * 100_000, ",".join(["bogus"] * 20_000),
                                   ",".join(f"n{i}" for i in range(20_000))])
def test_unknown_names_are_deduplicated_and_cut(value):
    with pytest.raises(ValueError) as caught:
        env.resolve_selection(["ddp_hooks"], environ={env.SELECT: value})
    message = str(caught.value)
    assert len(message) < 400 and message.count("'bogus'") <= 1 and "valid names: ddp_hooks" in message
    if value.startswith("n0,"):
        assert "'n0', 'n1', 'n2', 'n3', 'n4' and 19995 more" in message
