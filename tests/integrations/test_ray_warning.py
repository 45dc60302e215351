"""apply() in a Ray driver does not reach the actors: ray.init warns once unless its runtime_env
passes MEGATRON_RL_PATCHES on. A stand-in `ray` module with ray.init's calling convention."""
from __future__ import annotations

import importlib
import logging
import sys

import pytest

import megatron_rl_patches

RAY = "def init(address=None, *, runtime_env=None, **kwargs):\n    return ('started', address, runtime_env)\n"


@pytest.fixture
def fake_ray(tmp_path, clean_patch_state):
    saved = sys.modules.pop("ray", None)
    (tmp_path / "ray.py").write_text(RAY)
    clean_patch_state.syspath_prepend(str(tmp_path))
    yield
    megatron_rl_patches.revert()
    sys.modules.pop("ray", None)
    if saved is not None:
        sys.modules["ray"] = saved


def ours(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "megatron_rl_patches" and "Ray" in r.getMessage()]


def test_ray_init_warns_once_when_apply_cannot_reach_the_actors(fake_ray, caplog):
    megatron_rl_patches.apply(only="ddp_hooks")
    ray = importlib.import_module("ray")  # imported after apply(): the post-import hook wraps init
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        assert ray.init() == ("started", None, None)  # behaviour unchanged
        ray.init("auto")
    messages = ours(caplog)
    assert len(messages) == 1 and "runtime_env={'env_vars': {'MEGATRON_RL_PATCHES': 'all'}}" in messages[0]


def test_no_warning_when_the_runtime_env_carries_the_selection(fake_ray, caplog):
    ray = importlib.import_module("ray")  # imported before apply(): wrapped at once
    megatron_rl_patches.apply(only="ddp_hooks")
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        ray.init(runtime_env={"env_vars": {"MEGATRON_RL_PATCHES": "all"}})
    assert ours(caplog) == []


def test_no_warning_without_apply_and_revert_restores_init(fake_ray, caplog):
    ray = importlib.import_module("ray")
    original = ray.init
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        ray.init()
    assert ours(caplog) == []
    megatron_rl_patches.apply(only="ddp_hooks")
    assert ray.init is not original
    megatron_rl_patches.revert()
    assert ray.init is original
