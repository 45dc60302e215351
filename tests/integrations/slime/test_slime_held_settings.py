"""slime's doors read its settings once per slime `args` (issues 106 and 107): top-k OPD's and the
shared-prefix switch, held by the namespace every patched slime call is handed, then passed down."""
from __future__ import annotations

import types

import pytest

from megatron_rl_patches.integrations.slime import step_plan as plan

TEACHERS, SHARED = "MEGATRON_RL_PATCHES_OPD_TEACHERS", "MEGATRON_RL_PATCHES_SHARED_PREFIX"


def test_the_settings_are_read_at_the_first_door_and_held_by_args(monkeypatch):
    monkeypatch.delenv(TEACHERS, raising=False)
    monkeypatch.setenv(SHARED, " on ")
    args = types.SimpleNamespace()
    assert plan.held_settings(args) == (None, True)
    monkeypatch.setenv(SHARED, "0")
    monkeypatch.setenv(TEACHERS, "/a")
    assert plan.held_settings(args) == (None, True) and plan.slime_settings(args) is None  # held: not read again
    fresh = types.SimpleNamespace()
    settings, shared = plan.held_settings(fresh)
    assert shared is False and [t.path for t in settings.teachers] == ["/a"]
    assert plan.slime_settings(fresh) is settings
    assert plan.slime_prefix(fresh, None, "a pass", training=True) is None  # off: the model is never looked at


def test_a_bad_switch_is_refused_by_name_and_nothing_is_held(monkeypatch):
    monkeypatch.delenv(TEACHERS, raising=False)
    monkeypatch.setenv(SHARED, "maybe")
    args = types.SimpleNamespace()
    with pytest.raises(ValueError, match="MEGATRON_RL_PATCHES_SHARED_PREFIX='maybe' is not a switch: use 1"):
        plan.held_settings(args)
    assert not hasattr(args, plan.HELD)
    monkeypatch.setenv(SHARED, "1")
    assert plan.held_settings(args) == (None, True)


def test_args_that_hold_nothing_are_read_for_each_call(monkeypatch):
    monkeypatch.delenv(TEACHERS, raising=False)
    monkeypatch.setenv(SHARED, "1")
    assert plan.held_settings(None) == (None, True)
    monkeypatch.setenv(SHARED, "")
    assert plan.held_settings(None) == (None, False)
