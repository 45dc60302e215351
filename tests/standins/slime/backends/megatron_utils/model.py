"""Test stand-in for `slime.backends.megatron_utils.model`, the one every test uses (tests put
tests/standins on sys.path, or copy this package to write a variant): slime's names and
signatures, and a Megatron-style train() on real megatron-core (CPU) with the steps that break
when it runs once per rollout.

Like Megatron-LM's and slime's train(): the `config.no_sync_func is None` assert and the
sync-function install, forward pre-hooks disabled at entry, enabled after step 0 and disabled at
exit through module-level helpers, the real forward-backward schedule with
`finalize_model_grads`, and a tiny SGD on `main_grad` standing in for the distributed optimizer.
Like slime, `initialize_model_and_optimizer(args, role)` builds a DDP-wrapped model from
`.model_provider` and loads it through `.checkpoint`. torch and megatron-core are imported inside
the functions: importing this module is cheap (start-up and registry tests import it).
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from .checkpoint import load_checkpoint
from .model_provider import get_model_provider_func


@dataclass
class TrainArgs:
    """The command-line flags train() reads (Megatron-LM names)."""

    overlap_grad_reduce: bool = True
    align_grad_reduce: bool = True
    use_distributed_optimizer: bool = True
    overlap_param_gather: bool = True
    align_param_gather: bool = True
    fail_at_step: int | None = None  # raise InjectedFailure after this step's backward


_args = TrainArgs()


def get_args() -> TrainArgs:
    return _args


def set_args(**values: Any) -> TrainArgs:
    global _args
    _args = TrainArgs(**values)
    return _args


class InjectedFailure(RuntimeError):
    """Raised by train() at `fail_at_step`, to test state restoration."""


class MainGradSGD:
    """The optimizer argument: plain SGD on `param.main_grad`."""

    def __init__(self, lr: float = 0.1) -> None:
        self.lr = lr

    def step(self, model: Sequence[Any]) -> None:
        from megatron_rl_patches.testing.megatron_cpu import sgd_step

        sgd_step(model, lr=self.lr)


def enable_forward_pre_hook(model_chunks: Sequence[Any]) -> None:
    from megatron.core.distributed import DistributedDataParallel

    for chunk in model_chunks:
        assert isinstance(chunk, DistributedDataParallel)
        chunk.enable_forward_pre_hook()


def disable_forward_pre_hook(model_chunks: Sequence[Any], param_sync: bool = True) -> None:
    from megatron.core.distributed import DistributedDataParallel

    for chunk in model_chunks:
        assert isinstance(chunk, DistributedDataParallel)
        chunk.disable_forward_pre_hook(param_sync=param_sync)


def _one_or_list(items: list[Any]) -> Any:
    return items[0] if len(items) == 1 else items


def _forward_backward_per_chunk(model: Sequence[Any], batches: Sequence[dict], config: Any) -> list[Any]:
    """Several independent chunks without a virtual pipeline (which needs PP > 1): every chunk
    runs every micro-batch, grad sync held back by its own no_sync until the last one."""
    from megatron_rl_patches.testing.megatron_cpu import lm_loss_forward_step

    no_sync = config.no_sync_func
    if not isinstance(no_sync, list):
        no_sync = [contextlib.nullcontext] * len(model)
    losses = []
    for chunk, chunk_no_sync in zip(model, no_sync):
        for index, batch in enumerate(batches):
            last = index == len(batches) - 1
            with contextlib.nullcontext() if last else chunk_no_sync():
                output, loss_func = lm_loss_forward_step(iter([batch]), chunk)
                loss, metrics = loss_func(output)
                (loss / len(batches)).backward()
            losses.append(metrics["lm loss"])
    config.finalize_model_grads_func(list(model))
    return losses


def _interleaved() -> bool:
    """The chunks are virtual pipeline stages: megatron-core's interleaved schedule runs them."""
    from megatron.core import parallel_state

    return bool(parallel_state.get_virtual_pipeline_model_parallel_world_size())


def _main_grads(model: Sequence[Any]) -> Any:
    import torch

    params = [p for chunk in model for p in chunk.module.parameters()]
    return torch.cat([p.main_grad.detach().flatten().clone() for p in params])


def train(rollout_id, model, optimizer, opt_param_scheduler, data_iterator, num_microbatches,
          global_batch_sizes=None):
    """Train on one rollout: `data_iterator[step]` holds that step's micro-batches (`model`: a
    list of DDP chunks, `optimizer`: a MainGradSGD). Returns the losses and the main grads of
    every step (slime returns nothing; the tests need them)."""
    import torch
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    from megatron_rl_patches.testing.megatron_cpu import lm_loss_forward_step, run_schedule

    args = get_args()
    if len(data_iterator) != len(num_microbatches):
        raise ValueError(f"{len(data_iterator)} steps of data but num_microbatches has {len(num_microbatches)}")
    for chunk in model:
        chunk.train()
    config = get_model_config(model[0])

    if args.overlap_grad_reduce:
        assert config.no_sync_func is None, (
            "with overlap_grad_reduce, config.no_sync_func must be None: a custom no_sync_func "
            "cannot be combined with overlapped grad reduction"
        )
        config.no_sync_func = _one_or_list([chunk.no_sync for chunk in model])
        if args.align_grad_reduce:
            config.grad_sync_func = _one_or_list([chunk.start_grad_sync for chunk in model])
    if args.overlap_param_gather and args.align_param_gather:
        config.param_sync_func = _one_or_list([chunk.start_param_sync for chunk in model])
    config.finalize_model_grads_func = finalize_model_grads

    toggle_hooks = args.use_distributed_optimizer and args.overlap_param_gather
    hooks_on = False
    param_sync_func = None
    if toggle_hooks:
        disable_forward_pre_hook(model, param_sync=False)
        # forward_backward_func must not all-gather params before step 0 succeeded
        param_sync_func, config.param_sync_func = config.param_sync_func, None

    losses, grads = [], []
    for step, (batches, count) in enumerate(zip(data_iterator, num_microbatches)):
        if len(batches) != count:
            raise ValueError(f"step {step}: {len(batches)} micro-batches, num_microbatches says {count}")
        for chunk in model:
            chunk.zero_grad_buffer()
        if len(model) == 1 or _interleaved():
            step_losses = [m["lm loss"] for m in run_schedule(model, batches, lm_loss_forward_step)]
        else:
            step_losses = _forward_backward_per_chunk(model, batches, config)
        # a pipeline's earlier stages see no loss
        losses.append(torch.stack(step_losses) if step_losses else torch.zeros(0))
        grads.append(_main_grads(model))
        if args.fail_at_step == step:
            raise InjectedFailure(f"rollout {rollout_id}: injected failure at step {step}")
        optimizer.step(model)
        if opt_param_scheduler is not None:
            opt_param_scheduler.step(increment=count)
        if step == 0 and toggle_hooks:
            enable_forward_pre_hook(model)
            config.param_sync_func = param_sync_func
            hooks_on = True

    if hooks_on:
        disable_forward_pre_hook(model)
    return {"rollout_id": rollout_id, "losses": losses, "grads": grads}


def setup_model_and_optimizer(args: Any, role: str = "actor") -> tuple[list[Any], Any, Any]:
    from megatron_rl_patches.testing.megatron_cpu import wrap_ddp

    model = [wrap_ddp(get_model_provider_func(args, role)())]
    return model, SimpleNamespace(kind="optimizer"), SimpleNamespace(kind="scheduler")


def initialize_model_and_optimizer(args: Any, role: str = "actor") -> tuple[list[Any], Any, Any, int]:
    """slime's signature: (model, optimizer, scheduler, iteration), chunk 0 tagged with its role."""
    model, optimizer, opt_param_scheduler = setup_model_and_optimizer(args, role)
    model[0].role = role
    iteration, _ = load_checkpoint(model, optimizer, opt_param_scheduler, {}, False)
    return model, optimizer, opt_param_scheduler, iteration


# ----------------------------------------------------------------------------- slime_fused's targets
# slime's forward steps, with its names and signatures (624b824a): the slime_fused records wrap
# them here; their behaviour is tested on slime's real source (the slime lane).


class StandInOnly(LookupError):
    """Raised by the stand-ins of functions only the slime lane runs for real."""


def forward_only(f, args, model, data_iterator, num_microbatches, store_prefix="", use_rollout_top_p_replay=False):
    raise StandInOnly("forward_only: run the slime lane for slime's own")


def train_one_step(args, rollout_id, step_id, data_iterator, model, optimizer, opt_param_scheduler,
                   num_microbatches, step_global_batch_size, microbatch_pbar=None):
    raise StandInOnly("train_one_step: run the slime lane for slime's own")


def get_batch(data_iterator, keys, pad_multiplier=128, allgather_cp=False):
    raise StandInOnly("get_batch: run the slime lane for slime's own")


def get_forward_backward_func(*args, **kwargs):
    """Megatron's schedule getter, bound by name in slime's model module."""
    raise StandInOnly("get_forward_backward_func: run the slime lane for slime's own")
