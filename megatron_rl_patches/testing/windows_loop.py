"""Split train-step loops on real megatron-core (CPU): several schedule calls per optimizer step,
as NeMo-RL's split train step and SkyRL's forward_backward/optim_step do. Used by the
accumulation-window tests and `bench windows`.

A window is a list of schedule calls, each given as its number of microbatches: `[[1, 1], [1, 1, 1]]`
is two optimizer steps, of 2 then 3 calls of one microbatch. `FINALIZE` / `FINISH` in a window's
list call `finalize_model_grads` / every chunk's `finish_grad_sync` there, inside the window:
`[[1, FINALIZE, 1]]`. Data depends on (rank, window, call, microbatch) only, so a run and its
synchronous reference (`overlap_grad_reduce=False`) see the same.
"""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_rl_patches.testing.megatron_cpu import check_interleaved_p2p, gpt_forward, make_batch, wrap_ddp
from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config as tiny_gpt_config
from megatron_rl_patches.windows import bucket_groups

FINALIZE = "finalize"  # finalize_model_grads(chunks, **finalize_kwargs) inside the window
FINISH = "finish"  # chunk.finish_grad_sync(**finalize_kwargs) on every chunk inside the window
Windows = Sequence[Sequence[int | str]]


@dataclass
class LoopSetup:
    """What one run builds: DDP chunks (one, or one per virtual stage) and an optional optimizer."""

    chunks: list[Any]
    optimizer: Any = None
    config: Any = None
    forward_steps: list[int] = field(default_factory=lambda: [0])  # microbatches run so far
    # the microbatch of a seed (`batch_seed`): a layout's rows (e.g. a context-parallel rank's slice)
    batch: Callable[..., dict] = make_batch


def build(env: Any, ddp_flags: dict, optimizer: str | None = None, *, virtual: int | None = None,
          lr: float = 0.05, seed: int = 0) -> LoopSetup:
    """Tiny GPT chunks (a list of `virtual` ones for the interleaved schedule) in real DDP with
    `ddp_flags`, and Megatron's optimizer ("sgd" / "adam", distributed when the flags say so)."""
    from megatron.core import parallel_state

    config = env.config()
    stages = range(virtual) if virtual else [None]
    chunks = []
    for vp_stage in stages:
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage) if vp_stage is not None \
            else parallel_state.is_pipeline_first_stage()
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage) if vp_stage is not None \
            else parallel_state.is_pipeline_last_stage()
        chunks.append(env.gpt(config, pre_process=pre, post_process=post, vp_stage=vp_stage, seed=seed))
    return wrap(chunks, config, ddp_flags, optimizer, lr=lr)


def wrap(models: Sequence[Any], config: Any, ddp_flags: dict, optimizer: str | None = None, *, lr: float = 0.05,
         **optimizer_flags: Any) -> LoopSetup:
    """`models` (this rank's chunks, built on `config`) in real DDP with `ddp_flags`, Megatron's
    optimizer ("sgd" / "adam", distributed when the flags say so; `optimizer_flags` such as bf16=True
    go to its OptimizerConfig) and the config's sync functions as a split train step leaves them."""
    chunks = [wrap_ddp(model, **ddp_flags) for model in models]
    setup = LoopSetup(chunks=chunks, config=config)
    if optimizer is not None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        opt_config = OptimizerConfig(optimizer=optimizer, lr=lr, clip_grad=0.0,
                                     use_distributed_optimizer=bool(ddp_flags.get("use_distributed_optimizer")),
                                     **optimizer_flags)
        setup.optimizer = get_megatron_optimizer(opt_config, chunks)
    no_sync = [chunk.no_sync for chunk in chunks]
    config.no_sync_func = no_sync if len(chunks) > 1 else no_sync[0]
    config.finalize_model_grads_func = None
    return setup


def batch_seed(rank: int, window: int, call: int, microbatch: int) -> int:
    return 100_000 * rank + 1_000 * window + 10 * call + microbatch


def forward_step(setup: LoopSetup, skip_embedding: bool = False) -> Callable:
    """A schedule forward step: mean next-token loss; with `skip_embedding` the decoder input is
    the embedding's output detached, so the position embedding gets no gradient."""

    def step(data_iterator: Iterator[dict], model: Any) -> tuple[torch.Tensor, Callable]:
        setup.forward_steps[0] += 1
        batch = next(data_iterator)
        if skip_embedding and getattr(model.module, "pre_process", False):
            embedded = model.module.embedding(batch["tokens"], batch["position_ids"]).detach()
            output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                           decoder_input=embedded, labels=batch["labels"])
        else:
            output = gpt_forward(model, batch, labels=True)

        def loss_func(out: torch.Tensor) -> tuple[torch.Tensor, dict]:
            loss = out.float().mean()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    return step


def schedule_call(setup: LoopSetup, batches: list[dict], step: Callable) -> None:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    check_interleaved_p2p(setup.chunks)
    micro_batch_size, seq_length = batches[0]["tokens"].shape
    # the interleaved schedule reads one iterator per model chunk, each over every microbatch
    data = [iter(batches) for _ in setup.chunks]
    get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=data if len(data) > 1 else data[0],
        model=setup.chunks,
        num_microbatches=len(batches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
    )


def own_grad(chunk: Any, whole_buffer: bool = False) -> torch.Tensor:
    """The reduced gradient this rank owns: the whole buffer, or its shard of every bucket under
    the distributed optimizer (the rest of the buffer holds unreduced data after reduce-scatter,
    all of it with `whole_buffer`: a force_all_reduce step reduces every element)."""
    parts = []
    sharded = chunk.ddp_config.use_distributed_optimizer and not whole_buffer
    world = torch.distributed.get_world_size(chunk.intra_dp_cp_group) if hasattr(chunk, "intra_dp_cp_group") \
        else torch.distributed.get_world_size()
    rank = torch.distributed.get_rank(chunk.intra_dp_cp_group) if hasattr(chunk, "intra_dp_cp_group") \
        else torch.distributed.get_rank()
    for buffer in chunk.buffers:
        for bucket in buffer.buckets:
            data = bucket.grad_data
            if sharded:
                size = data.numel() // world
                data = data[rank * size:(rank + 1) * size]
            parts.append(data.detach().clone())
    return torch.cat(parts)


def params_of(setup: LoopSetup) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for chunk in setup.chunks for p in chunk.module.parameters()])


def reduce_in_flight(setup: LoopSetup) -> bool:
    """True while some bucket group of the run still has a gradient reduce started and not waited for."""
    return any(group.grad_reduce_handle is not None for chunk in setup.chunks for group in bucket_groups(chunk))


def run_windows(setup: LoopSetup, windows: Windows, *, rank: int, window_cm: Callable[[], Any] | None = None,
                skip_embedding_in: Sequence[int] = (), finalize_in_call: bool = False,
                finalize_kwargs: dict | None = None, whole_buffer: bool = False) -> dict:
    """Run each window (zero grads, its schedule calls, finalize_model_grads, optimizer step if any);
    return the own-shard grads per window (`whole_buffer`: every element), whether a reduce was
    still in flight after each window's finalize, and the parameters at the end. `window_cm()` wraps
    each window's calls (accumulation_window); `finalize_in_call` sets config.finalize_model_grads_func
    (one call per window, as Megatron-LM's train_step); `finalize_kwargs` go to every finalize and
    finish (force_all_reduce)."""
    from megatron.core.distributed import finalize_model_grads

    kwargs = finalize_kwargs or {}
    grads, in_flight = [], []
    for w, calls in enumerate(windows):
        for chunk in setup.chunks:
            chunk.zero_grad_buffer()
        if setup.optimizer is not None:
            setup.optimizer.zero_grad()
        step = forward_step(setup, skip_embedding=w in skip_embedding_in)
        setup.config.finalize_model_grads_func = finalize_model_grads if finalize_in_call else None
        with window_cm() if window_cm is not None else contextlib.nullcontext():
            for c, count in enumerate(calls):
                if count == FINALIZE:
                    finalize_model_grads(setup.chunks, **kwargs)
                elif count == FINISH:
                    for chunk in setup.chunks:
                        chunk.finish_grad_sync(**kwargs)
                else:
                    batches = [setup.batch(seed=batch_seed(rank, w, c, m)) for m in range(int(count))]
                    schedule_call(setup, batches, step)
        if not finalize_in_call:
            finalize_model_grads(setup.chunks, **kwargs)
        in_flight.append(reduce_in_flight(setup))
        grads.append(torch.cat([own_grad(chunk, whole_buffer) for chunk in setup.chunks]))
        if setup.optimizer is not None:
            setup.optimizer.step()
    setup.config.finalize_model_grads_func = None
    return {"grads": grads, "in_flight": in_flight, "params": params_of(setup)}
