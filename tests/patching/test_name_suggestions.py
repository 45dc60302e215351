"""Every patch-name list suggests the close name (issue 29: `MEGATRON_RL_PATCHES=ddp_hook` applied
nothing and said only "unknown"): the variable, DISABLE, `apply(only=...)`, `exclude=`, and `run --patches`."""
from __future__ import annotations

import pytest

import megatron_rl_patches
from megatron_rl_patches.integrations import default_registry
from megatron_rl_patches.patching import env
from megatron_rl_patches.patching.startup import launcher

KNOWN = default_registry().patch_names()


@pytest.mark.parametrize(("kwargs", "source"), [
    ({"environ": {env.SELECT: "ddp_hook,train_reentry"}}, env.SELECT),
    ({"environ": {env.DISABLE: " DDP_HOOKS"}}, env.DISABLE),
    ({"only": ["ddp_hook"]}, "only="),
    ({"exclude": "ddp_hokos"}, "exclude="),
])
def test_an_unknown_name_suggests_the_close_one(kwargs, source):
    with pytest.raises(ValueError) as caught:
        env.selection(KNOWN, **kwargs)
    message = str(caught.value)
    assert f"in {source} (did you mean ddp_hooks?)" in message and "valid names: ddp_hooks" in message


def test_apply_suggests_and_changes_nothing(clean_patch_state):
    before = [status.as_dict() for status in megatron_rl_patches.applied()]
    with pytest.raises(ValueError, match=r"did you mean grad_windows\?"):
        megatron_rl_patches.apply(only="grad_window")
    assert [status.as_dict() for status in megatron_rl_patches.applied()] == before


def test_several_unknown_names_get_one_suggestion_each_and_none_for_nonsense():
    with pytest.raises(ValueError) as caught:
        env.selection(KNOWN, only="ddp_hook,slime_logprob,zzzz")
    message = str(caught.value)
    assert "did you mean ddp_hooks for 'ddp_hook', slime_logprobs for 'slime_logprob'?" in message
    with pytest.raises(ValueError) as caught:
        env.selection(KNOWN, only="zzzz")
    assert "did you mean" not in str(caught.value)


def test_the_launcher_suggests_for_its_option():
    with pytest.raises(ValueError, match=r"in --patches \(did you mean train_reentry\?\)"):
        launcher.launch_environment("train_rentry", {"PATH": "/usr/bin"})
