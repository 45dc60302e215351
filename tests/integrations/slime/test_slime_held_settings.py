"""slime's doors read its settings once per slime `args` (issues 106 and 107): top-k OPD's and the
shared-prefix switch, held by the namespace every patched slime call is handed, then passed down."""
from __future__ import annotations

import types

import pytest

from megatron_rl_patches.integrations.slime import fused_step
from megatron_rl_patches.integrations.slime.fused_step import SlimeSettings

TEACHERS, SHARED = "MEGATRON_RL_PATCHES_OPD_TEACHERS", "MEGATRON_RL_PATCHES_SHARED_PREFIX"


def test_the_settings_are_read_at_the_first_door_and_held_by_args(monkeypatch):
    monkeypatch.delenv(TEACHERS, raising=False)
    monkeypatch.setenv(SHARED, " on ")
    args = types.SimpleNamespace()
    assert fused_step.held_settings(args) == SlimeSettings(opd=None, shared_prefix=True)
    monkeypatch.setenv(SHARED, "0")
    monkeypatch.setenv(TEACHERS, "/a")
    assert fused_step.held_settings(args) == SlimeSettings(opd=None, shared_prefix=True)  # held: not read again
    assert fused_step.slime_settings(args) is None
    fresh = types.SimpleNamespace()
    held = fused_step.held_settings(fresh)
    settings = held.opd
    assert held.shared_prefix is False and [t.path for t in settings.teachers] == ["/a"]
    with pytest.raises(TypeError):
        held[0]  # named fields, never read by position (issue 113)
    assert fused_step.slime_settings(fresh) is settings
    assert fused_step.slime_prefix_pass(fresh, None, "a pass", training=True) is None  # off: the model is not read


def test_a_bad_switch_is_refused_by_name_and_nothing_is_held(monkeypatch):
    monkeypatch.delenv(TEACHERS, raising=False)
    monkeypatch.setenv(SHARED, "maybe")
    args = types.SimpleNamespace()
    with pytest.raises(ValueError, match="MEGATRON_RL_PATCHES_SHARED_PREFIX='maybe' is not a switch: use 1"):
        fused_step.held_settings(args)
    assert not hasattr(args, fused_step.HELD)
    monkeypatch.setenv(SHARED, "1")
    assert fused_step.held_settings(args) == SlimeSettings(opd=None, shared_prefix=True)


def test_args_that_hold_nothing_are_read_for_each_call(monkeypatch):
    monkeypatch.delenv(TEACHERS, raising=False)
    monkeypatch.setenv(SHARED, "1")
    assert fused_step.held_settings(None) == SlimeSettings(opd=None, shared_prefix=True)
    monkeypatch.setenv(SHARED, "")
    assert fused_step.held_settings(None) == SlimeSettings(opd=None, shared_prefix=False)
