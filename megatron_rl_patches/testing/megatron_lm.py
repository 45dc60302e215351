"""Megatron-LM's real training loop (`megatron.training`, shipped in megatron-core wheels from 0.17)
on CPU: its own argument parsing and validation, globals, `setup_model_and_optimizer` (real DDP,
real distributed optimizer) and `train()`, on a tiny GPT.

Not real, each for a named reason: the CPU shims (`shims.py`); a gloo world and parallel state set
up by `megatron_world` instead of `initialize_megatron` (it asserts CUDA); `sys.argv` replaced
while `parse_args()` runs (it reads nothing else); no tokenizer (`set_global_variables(...,
build_tokenizer=False)` with `args.padded_vocab_size`); our own forward step and data.
"""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch

from megatron_rl_patches.testing.megatron_cpu import (
    TINY_SEQ,
    TINY_VOCAB,
    build_tiny_gpt,
    gpt_forward,
    make_batch,
    megatron_world,
)

MICRO_BATCH, GLOBAL_BATCH = 2, 4
MICROBATCHES = GLOBAL_BATCH // MICRO_BATCH  # per step, at data-parallel size 1

# A tiny GPT with overlapped grad reduce, the distributed optimizer and overlapped param gather;
# fused kernels, Transformer Engine and persistent layer norm off (CPU).
TRAIN_ARGV: tuple[str, ...] = (
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", str(TINY_SEQ), "--max-position-embeddings", str(TINY_SEQ),
    "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(GLOBAL_BATCH),
    "--train-iters", "2", "--lr", "0.01", "--seed", "1234",
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
    "--transformer-impl", "local", "--use-cpu-initialization", "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--position-embedding-type", "learned_absolute", "--distributed-backend", "gloo",
    "--log-interval", "1000", "--eval-interval", "1000000", "--eval-iters", "0",
)  # fmt: skip


def unavailable_reason() -> str | None:
    """Why Megatron-LM's training loop cannot run here, or None when it can."""
    try:
        import megatron.training.training  # noqa: F401
    except ImportError as exc:
        return f"megatron.training is not importable ({exc}); megatron-core wheels ship it from 0.17 on"
    return None


def parse_megatron_args(argv: Sequence[str]) -> Any:
    """Megatron-LM's `parse_args()` (which reads only `sys.argv`) on `argv`, then `validate_args`."""
    from megatron.training.arguments import parse_args, validate_args

    with mock.patch.object(sys, "argv", ["megatron-lm-train", *argv]):
        args = parse_args()
    validate_args(args)
    return args


def call_by_name(func: Callable[..., Any], **values: Any) -> Any:
    """Call `func` with the values its signature names: argument order and optional arguments
    differ between releases (e.g. `setup_model_and_optimizer(model_type, model_provider_func)` in
    0.19, the other way round before)."""
    params = inspect.signature(func).parameters
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    missing = [n for n, p in params.items() if p.default is p.empty and p.kind not in variadic and n not in values]
    if missing:
        raise TypeError(f"{func.__module__}.{func.__qualname__} needs {missing}, which this kit does not provide")
    return func(**{name: value for name, value in values.items() if name in params})


@dataclass
class TrainState:
    """What `setup_model_and_optimizer` built, plus the loop position Megatron-LM keeps in args."""

    model: list[Any]
    optimizer: Any
    scheduler: Any
    config: Any
    iteration: int = 0
    consumed_samples: int = 0
    flops: float = 0.0


@dataclass
class MegatronLMSession:
    """Handle of `megatron_lm_session()`: build a model and optimizer, run train() per rollout."""

    args: Any
    seed: int = 0
    losses: list[torch.Tensor] = field(default_factory=list)

    def provider(
        self, pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None, **kwargs: Any
    ) -> Any:
        """A Megatron-LM model provider: the tiny GPT with the config Megatron-LM derives from args."""
        from megatron.training.arguments import core_transformer_config_from_args

        config = core_transformer_config_from_args(self.args)
        return build_tiny_gpt(
            config, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage, seed=self.seed
        )

    def build(self) -> TrainState:
        """A fresh model (same weights every time) with real DDP, optimizer and scheduler; the
        global interval timer is reset as in a new process."""
        from megatron.core.enums import ModelType
        from megatron.core.utils import get_model_config
        from megatron.training import training

        reset_interval_timer()
        model, optimizer, scheduler = call_by_name(
            training.setup_model_and_optimizer,
            model_provider_func=self.provider,
            model_type=ModelType.encoder_or_decoder,
        )
        return TrainState(model, optimizer, scheduler, get_model_config(model[0]))

    def forward_step(self, data_iterator: Iterator[dict], model: Any) -> tuple[torch.Tensor, Callable]:
        """Mean next-token cross entropy; every micro-batch's loss is kept in `self.losses`."""
        batch = next(data_iterator)
        per_token = gpt_forward(model, batch, labels=True)

        def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict]:
            loss = output.float().mean()
            self.losses.append(loss.detach().clone())
            return loss, {"lm loss": loss.detach().clone()}

        return per_token, loss_func

    def train(self, state: TrainState, rollout: int, steps: int = 2) -> list[torch.Tensor]:
        """One call of the real `megatron.training.training.train` (looked up now, so patches
        apply) for `steps` iterations on this rollout's data; returns the micro-batch losses."""
        from megatron.training import training

        args = self.args
        args.iteration, args.consumed_train_samples = state.iteration, state.consumed_samples
        args.num_floating_point_operations_so_far = state.flops
        args.train_iters = state.iteration + steps
        batches = iter([make_batch(MICRO_BATCH, seed=1000 * rollout + i) for i in range(steps * MICROBATCHES)])
        start = len(self.losses)
        state.iteration, state.flops = call_by_name(
            training.train,
            forward_step_func=self.forward_step,
            model=state.model,
            optimizer=state.optimizer,
            opt_param_scheduler=state.scheduler,
            train_data_iterator=batches,
            valid_data_iterator=None,
            process_non_loss_data_func=None,
            config=state.config,
            checkpointing_context={},
            non_loss_data_func=None,
        )
        state.consumed_samples = args.consumed_train_samples
        return self.losses[start:]


def reset_sync_funcs(state: TrainState) -> None:
    """Clear the sync functions train() installed in the shared config (its no_sync assert)."""
    config = state.config
    config.no_sync_func = config.grad_sync_func = config.param_sync_func = None


def reset_interval_timer() -> None:
    """Megatron-LM's train() starts the global 'interval-time' timer and returns with it running,
    so the next call's start() asserts 'timer has already been started'."""
    from megatron.training.global_vars import get_timers

    get_timers()("interval-time").reset()


def reset_by_hand(state: TrainState) -> None:
    """The control: everything a user resets between two train() calls without the patches
    (sync functions, the interval timer, forward pre-hooks back on as after construction)."""
    reset_sync_funcs(state)
    reset_interval_timer()
    for chunk in state.model:
        if not chunk.remove_forward_pre_hook_handles:
            chunk.enable_forward_pre_hook()


def run_rollouts(session: MegatronLMSession, rollouts: int = 3, by_hand: bool = False) -> list[list[torch.Tensor]]:
    """A fresh build, then one train() call per rollout (reset by hand in between for the control)."""
    state = session.build()
    losses = []
    for rollout in range(rollouts):
        if by_hand and rollout > 0:
            reset_by_hand(state)
        losses.append(session.train(state, rollout))
    return losses


@contextlib.contextmanager
def megatron_lm_session(argv: Sequence[str] = TRAIN_ARGV) -> Iterator[MegatronLMSession]:
    """A CPU world with Megatron-LM's arguments and globals set from `argv`; all torn down on exit."""
    reason = unavailable_reason()
    if reason is not None:
        raise ImportError(reason)
    from megatron.core import num_microbatches_calculator
    from megatron.training import global_vars

    with megatron_world():
        args = parse_megatron_args(argv)
        args.padded_vocab_size = TINY_VOCAB
        global_vars.set_global_variables(args, build_tokenizer=False)
        try:
            yield MegatronLMSession(args)
        finally:
            global_vars.destroy_global_vars()
            num_microbatches_calculator.destroy_num_microbatches_calculator()
