"""Re-entrant train() on real megatron-core (CPU): a Megatron-style train() in the stand-in module
`slime.backends.megatron_utils.model` (tests/standins), DDP with overlap_grad_reduce,
use_distributed_optimizer and overlap_param_gather."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import megatron_rl_patches
from megatron_rl_patches.reentrant import reentrant_train
from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.multirank import run_multirank

pytestmark = pytest.mark.megatron

ROOT = Path(__file__).resolve().parents[1]
SLIME_MODEL = "slime.backends.megatron_utils.model"
OVERLAP = dict(overlap_grad_reduce=True, use_distributed_optimizer=True, overlap_param_gather=True)


@pytest.fixture
def standins(slime_standin):
    """The stand-in `slime` package importable (the `slime_standin` fixture): the rollout drivers
    and the stand-in model module, its train() flags reset."""
    import mrp_rollouts
    from slime.backends.megatron_utils import model as slime_model

    slime_model.set_args()
    return mrp_rollouts, slime_model


def assert_same_rollouts(actual: list[dict], expected: list[dict]) -> None:
    """Bit-identical losses and main grads, step by step."""
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        assert got["rollout_id"] == want["rollout_id"]
        for name in ("losses", "grads"):
            assert len(got[name]) == len(want[name])
            for a, b in zip(got[name], want[name]):
                assert torch.equal(a, b), (name, got["rollout_id"], (a - b).abs().max())


def assert_rollouts_learn(results: list[dict]) -> None:
    """Every rollout ran every step with finite, non-zero grads that change between rollouts."""
    for result in results:
        assert len(result["losses"]) == 2 and all(torch.isfinite(loss).all() for loss in result["losses"])
        assert all(g.abs().sum() > 0 for g in result["grads"])
    assert not torch.equal(results[0]["grads"][0], results[1]["grads"][0])


def test_unpatched_second_rollout_fails_both_ways(megatron_cpu_kind, standins):
    rollouts, slime_model = standins
    chunks = rollouts.build_chunks(megatron_cpu_kind)
    rollouts.run_rollout(slime_model.train, 0, chunks, megatron_cpu_kind)

    with pytest.raises(AssertionError, match="no_sync_func must be None"):
        rollouts.run_rollout(slime_model.train, 1, chunks, megatron_cpu_kind)

    config = chunks[0].config
    config.no_sync_func = config.grad_sync_func = config.param_sync_func = None
    with pytest.raises(KeyError) as excinfo:
        rollouts.run_rollout(slime_model.train, 1, chunks, megatron_cpu_kind)
    assert excinfo.traceback[-1].name == "disable_forward_pre_hook"
    assert excinfo.value.args[0] is chunks[0].module  # upstream indexes the handles by module

    chunks[0].enable_forward_pre_hook()
    with pytest.raises(AssertionError):  # and a second enable asserts
        chunks[0].enable_forward_pre_hook()


def test_reentrant_train_matches_a_by_hand_control(megatron_cpu_kind, standins):
    rollouts, slime_model = standins
    guarded = reentrant_train(slime_model.train)
    env = megatron_cpu_kind
    patched = rollouts.run_rollouts(guarded, rollouts.build_chunks(env), env)
    control = rollouts.run_rollouts(slime_model.train, rollouts.build_chunks(env), env, by_hand=True)
    assert_rollouts_learn(patched)
    assert_same_rollouts(patched, control)  # rollout 1 included: first-call behaviour unchanged


def test_two_chunks_through_the_registry_patches(megatron_cpu_kind, standins):
    rollouts, slime_model = standins
    control_chunks = rollouts.build_chunks(megatron_cpu_kind, 2)
    control = rollouts.run_rollouts(slime_model.train, control_chunks, megatron_cpu_kind, by_hand=True)

    statuses = megatron_rl_patches.apply(only=["ddp_hooks", "train_reentry"])
    applied = {s.target for s in statuses if s.status == "applied"}
    helpers = ("train", "enable_forward_pre_hook", "disable_forward_pre_hook")
    assert {f"{SLIME_MODEL}:{name}" for name in helpers} <= applied
    assert sum("DistributedDataParallel" in t for t in applied) == 2

    chunks = rollouts.build_chunks(megatron_cpu_kind, 2)
    patched = rollouts.run_rollouts(slime_model.train, chunks, megatron_cpu_kind)
    config = chunks[0].config
    assert config is chunks[1].config
    assert config.no_sync_func == [c.no_sync for c in chunks]
    assert config.param_sync_func == [c.start_param_sync for c in chunks]
    assert all(not c.remove_forward_pre_hook_handles for c in chunks)
    assert_rollouts_learn(patched)
    assert_same_rollouts(patched, control)


def test_failed_rollout_restores_state_and_the_next_one_runs(megatron_cpu_kind, standins):
    rollouts, slime_model = standins
    train = reentrant_train(slime_model.train)
    chunks = rollouts.build_chunks(megatron_cpu_kind)
    rollouts.run_rollout(train, 0, chunks, megatron_cpu_kind)
    config = chunks[0].config
    entry = (config.no_sync_func, config.grad_sync_func, config.param_sync_func)

    slime_model.set_args(fail_at_step=1)  # after the hooks were re-enabled
    with pytest.raises(slime_model.InjectedFailure):
        rollouts.run_rollout(train, 1, chunks, megatron_cpu_kind)
    assert (config.no_sync_func, config.grad_sync_func, config.param_sync_func) == entry
    assert config.no_sync_func is entry[0]
    assert not chunks[0].remove_forward_pre_hook_handles  # disabled, as at entry

    slime_model.set_args()
    result = rollouts.run_rollout(train, 2, chunks, megatron_cpu_kind)
    assert all(torch.isfinite(loss).all() for loss in result["losses"])


@pytest.mark.parametrize("param_sync", [True, False])
def test_ddp_hooks_patch_on_real_ddp(megatron_cpu_kind, mocker, param_sync):
    megatron_rl_patches.apply(only="ddp_hooks")
    ddp = megatron_cpu_kind.ddp(megatron_cpu_kind.model(), **OVERLAP)
    modules = set(ddp.module.modules())
    assert set(ddp.remove_forward_pre_hook_handles) == modules  # construction unchanged
    sync = mocker.spy(ddp, "start_param_sync")

    ddp.disable_forward_pre_hook(param_sync=False)
    ddp.disable_forward_pre_hook(param_sync=param_sync)  # KeyError unpatched
    assert ddp.remove_forward_pre_hook_handles == {}
    assert sync.call_args_list == ([mocker.call(force_sync=True)] if param_sync else [])

    ddp.enable_forward_pre_hook()
    handles = dict(ddp.remove_forward_pre_hook_handles)
    ddp.enable_forward_pre_hook()  # AssertionError unpatched
    assert ddp.remove_forward_pre_hook_handles == handles and set(handles) == modules

    megatron_rl_patches.revert()
    ddp.disable_forward_pre_hook(param_sync=False)
    with pytest.raises(KeyError):
        ddp.disable_forward_pre_hook()


def _param_sync_on_two_ranks(rank: int, world_size: int) -> dict:
    """Each rank writes its own value into the whole param buffer (as if it had updated only its
    distributed-optimizer shard); a hook-less disable with param_sync must all-gather the shards."""
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    megatron_rl_patches.apply(only="ddp_hooks")
    out = {}
    with megatron_on_cpu() as env:
        ddp = env.ddp(env.gpt(seed=0), **OVERLAP)
        ddp.disable_forward_pre_hook(param_sync=False)
        for param_sync in (False, True):
            for buffer in ddp.buffers:
                buffer.param_data.fill_(float(rank + 1))
            ddp.disable_forward_pre_hook(param_sync=param_sync)
            out[param_sync] = [b.param_data.clone() for bucket in ddp.buffers for b in bucket.buckets]
    megatron_rl_patches.revert()
    return out


@pytest.mark.multirank
@layouts.mark("distopt")
def test_param_sync_without_hooks_all_gathers_the_shards():
    ranks = run_multirank(_param_sync_on_two_ranks, 2, timeout=90)
    for rank, out in enumerate(ranks):
        assert all(torch.all(data == rank + 1) for data in out[False])  # nothing gathered
    for bucket0, bucket1 in zip(ranks[0][True], ranks[1][True]):
        assert torch.equal(bucket0, bucket1)
        half = bucket0.numel() // 2  # shard r of every bucket comes from rank r
        assert torch.all(bucket0[:half] == 1) and torch.all(bucket0[half:] == 2)


def test_env_var_patches_a_fresh_process(tmp_path, slime_standin):
    """MEGATRON_RL_PATCHES=all in a new interpreter: the start-up bootstrap (the installed .pth
    calls it; the dev venv has no .pth, so the script calls bootstrap.run() first) patches the
    stand-in train() and DDP on import; 1 and 2 chunks, 3 rollouts each, against a control."""
    from megatron_rl_patches.testing.fresh_process import run_with_patches

    result = run_with_patches(slime_standin / "mrp_rollouts.py", tmp_path / "rollouts.pt", [slime_standin, ROOT],
                              timeout=180)
    status = result["status"]
    for name in ("train", "enable_forward_pre_hook", "disable_forward_pre_hook"):
        assert status[f"{SLIME_MODEL}:{name}"] == "applied"
    ddp = "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel"
    assert status[f"{ddp}.enable_forward_pre_hook"] == status[f"{ddp}.disable_forward_pre_hook"] == "applied"
    assert status["megatron.training.training:train"] == "pending"  # not in the megatron-core wheel
    assert result["train_wrapped"]
    for num_chunks in (1, 2):
        assert_rollouts_learn(result["patched"][num_chunks])
        assert_same_rollouts(result["patched"][num_chunks], result["control"][num_chunks])
