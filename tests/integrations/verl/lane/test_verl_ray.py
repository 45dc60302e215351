"""MEGATRON_RL_PATCHES reaches verl's Ray workers through `runtime_env`: a real local Ray
cluster, a task that imports verl's modules (and nothing of ours) finds them patched."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("verl.models", reason="verl is not installed: run `make test-verl` (the verl lane)")
ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.verl, pytest.mark.slow]


def runtime_env() -> dict:
    """What a verl driver passes to ray.init: the selection, and (for an install without the
    wheel's start-up file, e.g. editable or PYTHONPATH) the launcher's start-up folder."""
    from megatron_rl_patches.patching.startup.launcher import ROOT_VARIABLE, launch_environment

    child = launch_environment("verl_fused_logprobs,verl_topk_kd")
    return {"env_vars": {name: child[name] for name in ("MEGATRON_RL_PATCHES", "PYTHONPATH", ROOT_VARIABLE)}}


def test_runtime_env_carries_the_patches_to_a_ray_worker(clean_patch_state):
    from megatron_rl_patches.integrations._ray import _carries_selection

    env = runtime_env()
    assert _carries_selection(env)  # ray.init(runtime_env=env) does not warn
    def worker_state() -> dict:  # defined here: Ray ships it by value (no import of this module there)
        import verl.models.mcore.model_forward_fused as fused
        import verl.trainer.distillation.megatron.losses as losses

        return {
            "selection": os.environ.get("MEGATRON_RL_PATCHES"),
            "topk_wrapped": hasattr(losses.compute_forward_kl_topk, "__wrapped__"),
            "processor_wrapped": hasattr(fused.fused_output_processor, "__wrapped__"),
        }

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, runtime_env=env)
    try:
        state = ray.get(ray.remote(worker_state).remote(), timeout=120)
    finally:
        ray.shutdown()
    assert state == {"selection": "verl_fused_logprobs,verl_topk_kd", "topk_wrapped": True, "processor_wrapped": True}
