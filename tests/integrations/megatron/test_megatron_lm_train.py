"""`train_reentry` against the REAL Megatron-LM train() (`megatron.training.training.train`, shipped
in megatron-core wheels from 0.17; skipped where it is not importable): a tiny GPT with
overlap-grad-reduce, the distributed optimizer and overlap-param-gather, built by Megatron-LM's own
`setup_model_and_optimizer`, trained by train() once per rollout on CPU.

Stubbed, each by name (all the rest is Megatron-LM's and megatron-core's code):
- the kit's CPU shims, listed in SHIMS below (checked against the kit by the first test), and CUDA
  factory calls (device="cuda") redirected to CPU;
- the gloo world and parallel state are set up directly: `initialize_megatron` asserts CUDA;
- `sys.argv` replaced while `parse_args()` runs (it reads nothing else);
- no tokenizer: `set_global_variables(args, build_tokenizer=False)` with `args.padded_vocab_size`;
- our own forward_step_func and data iterator (random tokens, mean next-token cross entropy).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import megatron_rl_patches

pytestmark = pytest.mark.megatron

ROOT = Path(__file__).resolve().parents[3]
TRAINING = "megatron.training.training"
DDP = "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel"
SHIMS = {
    "torch.cuda.current_device", "torch.cuda.synchronize", "CudaRNGStatesTracker.fork", "torch.cuda.Stream",
    "torch.cuda.current_stream", "Module.cuda", "Tensor.type", "Tensor.cuda",
    # the layout kit's: the MoE router without Transformer Engine (< 0.17), the torch norm under SP
    "megatron.core.transformer.moe.moe_utils.te_general_gemm", "WrappedTorchNorm.__new__",
    # activation recompute's CUDA RNG state
    "megatron.core.tensor_parallel.random._get_cuda_rng_state",
    "megatron.core.tensor_parallel.random._set_cuda_rng_state",
}  # fmt: skip


def _require_megatron_lm() -> None:
    pytest.importorskip("megatron.core")
    from megatron_rl_patches.testing.megatron_lm import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def megatron_lm():
    """One Megatron-LM session (world, arguments, globals) for the in-process tests."""
    _require_megatron_lm()
    from megatron_rl_patches.testing.megatron_lm import megatron_lm_session

    with megatron_lm_session() as session:
        yield session


def assert_same_losses(actual: list[list[torch.Tensor]], expected: list[list[torch.Tensor]]) -> None:
    """Bit-identical micro-batch losses, rollout by rollout; training moved them between rollouts."""
    assert len(actual) == len(expected) >= 2
    for rollout, (got, want) in enumerate(zip(actual, expected)):
        assert len(got) == len(want) > 0
        assert torch.equal(torch.stack(got), torch.stack(want)), (rollout, got, want)
        assert all(torch.isfinite(loss) for loss in got)
    assert not torch.equal(torch.stack(actual[0]), torch.stack(actual[1]))


def _statuses(statuses, module: str) -> dict[str, str]:
    return {s.target.split(":", 1)[1]: s.status for s in statuses if s.target.startswith(module + ":")}


def test_the_named_shims_are_exactly_the_kits():
    pytest.importorskip("megatron.core")
    from megatron_rl_patches.testing.shims import _shim_table

    assert {f"{getattr(owner, '__name__', owner)}.{name}" for owner, name, _ in _shim_table()} == SHIMS


@pytest.mark.slow
def test_second_train_call_fails_without_the_patch(megatron_lm):
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    state = megatron_lm.build()
    (chunk,) = state.model
    assert isinstance(chunk, DistributedDataParallel) and chunk.use_forward_hook
    flags = ("overlap_grad_reduce", "use_distributed_optimizer", "overlap_param_gather")
    assert all(getattr(chunk.ddp_config, flag) for flag in flags)
    optimizers = getattr(state.optimizer, "chained_optimizers", [state.optimizer])
    assert any(isinstance(optimizer, DistributedOptimizer) for optimizer in optimizers)
    first = megatron_lm.train(state, rollout=0)
    assert len(first) == 4 and all(torch.isfinite(loss) for loss in first)  # 2 steps x 2 micro-batches
    with pytest.raises(AssertionError, match="config.no_sync_func must be None"):
        megatron_lm.train(state, rollout=1)


@pytest.mark.slow
def test_patched_train_matches_a_by_hand_reset(megatron_lm):
    from megatron_rl_patches.testing.megatron_lm import run_rollouts

    control = run_rollouts(megatron_lm, by_hand=True)
    statuses = megatron_rl_patches.apply(only=["train_reentry", "ddp_hooks"])
    helpers = _statuses(statuses, TRAINING)
    assert helpers == dict.fromkeys(("train", "enable_forward_pre_hook", "disable_forward_pre_hook"), "applied")
    patched = run_rollouts(megatron_lm)  # three train() calls, nothing reset by hand
    assert_same_losses(patched, control)  # the first rollout included: first-call behaviour unchanged


@pytest.mark.slow
def test_ddp_hook_key_error_on_the_real_ddp_and_none_with_ddp_hooks(megatron_lm):
    """The no_sync assert fires first in train() (validate_args forces overlap-grad-reduce on with
    overlap-param-gather); cleared by hand, the interval timer is next; then the hook KeyError."""
    from megatron_rl_patches.testing.megatron_lm import reset_interval_timer, reset_sync_funcs

    state = megatron_lm.build()
    chunk = state.model[0]
    megatron_lm.train(state, rollout=0)
    assert chunk.remove_forward_pre_hook_handles == {}  # train() disabled the hooks at exit

    reset_sync_funcs(state)
    with pytest.raises(AssertionError, match="timer has already been started"):
        megatron_lm.train(state, rollout=1)

    reset_sync_funcs(state)
    reset_interval_timer()
    with pytest.raises(KeyError) as excinfo:
        megatron_lm.train(state, rollout=1)
    assert excinfo.traceback[-1].name == "disable_forward_pre_hook"
    assert excinfo.value.args[0] is chunk.module  # upstream indexes the handles by module

    statuses = megatron_rl_patches.apply(only="ddp_hooks")
    assert [s.status for s in statuses] == ["applied", "applied"], [s.reason for s in statuses]
    reset_sync_funcs(state)
    reset_interval_timer()
    losses = megatron_lm.train(state, rollout=1)
    assert len(losses) == 4 and all(torch.isfinite(loss) for loss in losses)
    assert chunk.remove_forward_pre_hook_handles == {}
    chunk.disable_forward_pre_hook()  # a second disable: no KeyError
    chunk.enable_forward_pre_hook()
    chunk.enable_forward_pre_hook()  # a second enable: no AssertionError
    assert set(chunk.remove_forward_pre_hook_handles) == set(chunk.module.modules())


@pytest.mark.slow
def test_env_var_patches_the_real_train_in_a_fresh_process(tmp_path):
    """MEGATRON_RL_PATCHES=all in a new interpreter: three train() calls with nothing reset by hand,
    then (patches reverted) the by-hand control in the same process."""
    _require_megatron_lm()
    from megatron_rl_patches.testing.fresh_process import run_with_patches

    script = Path(__file__).with_name("megatron_lm_rollouts.py")
    result = run_with_patches(script, tmp_path / "rollouts.pt", pythonpath=[ROOT])
    status = result["status"]
    for name in ("train", "enable_forward_pre_hook", "disable_forward_pre_hook"):
        assert status[f"{TRAINING}:{name}"] == "applied"
    for name in ("enable_forward_pre_hook", "disable_forward_pre_hook"):
        assert status[f"{DDP}.{name}"] == "applied"
    assert result["error"] is None, result["error"]
    assert_same_losses(result["patched"], result["control"])
