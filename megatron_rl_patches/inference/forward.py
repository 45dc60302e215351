"""Forward passes only, through megatron-core's own schedule (so pipeline parallelism works as in
training), collecting one output per micro-batch: logits by default, or log-probs."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from megatron_rl_patches.model.chunks import module_chunks
from megatron_rl_patches.ops.invariance import resolve_invariant
from megatron_rl_patches.ops.logprobs import log_probs_and_entropy
from megatron_rl_patches.ops.scoring_plan import positive_int

Collect = Callable[[torch.Tensor, Any], Any]


def _default_collect(output: Any, extra: Any) -> Any:
    """The output detached: a tensor (logits), or each tensor of an output processor's dict."""
    if isinstance(output, Mapping):
        return {key: value.detach() if isinstance(value, torch.Tensor) else value for key, value in output.items()}
    return output.detach()


@torch.no_grad()
def inference_forward(
    model_chunks: Sequence[torch.nn.Module] | torch.nn.Module,
    data_iterator: Iterator[Any] | Sequence[Iterator[Any]],
    forward_step_func: Callable[[Any, torch.nn.Module], Any],
    *,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None = None,
    collect: Collect | None = None,
) -> list[Any]:
    """Run `num_microbatches` forward passes with get_forward_backward_func()(forward_only=True)
    under no_grad; returns one collected result per micro-batch on the last pipeline stage
    (an empty list on the other stages).

    `forward_step_func(data_iterator, model)` returns the model output, or `(output, extra)`;
    `collect(output, extra)` turns it into the result (default: the output itself, e.g. logits;
    see `token_log_probs` for log-probs). Chunks are put in eval mode first.
    """
    chunks = module_chunks(model_chunks, "model_chunks")
    if not callable(forward_step_func):
        raise TypeError(
            f"forward_step_func must be callable(data_iterator, model), got {type(forward_step_func).__name__}"
        )
    if collect is not None and not callable(collect):
        raise TypeError(f"collect must be callable(output, extra) or None, got {type(collect).__name__}")
    num_microbatches = positive_int("num_microbatches", num_microbatches)
    seq_length = positive_int("seq_length", seq_length)
    micro_batch_size = positive_int("micro_batch_size", micro_batch_size)
    finish_with = collect or _default_collect
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in chunks:
        chunk.eval()

    def forward_step(iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Callable[..., Any]]:
        result = forward_step_func(iterator, model)
        output, extra = result if isinstance(result, tuple) and len(result) == 2 else (result, None)

        def finish(output_tensor: torch.Tensor, non_loss_data: bool = True) -> Any:
            return finish_with(output_tensor, extra)

        return output, finish

    # collect_non_loss_data: the schedule stores finish()'s return as is (no loss reduction)
    return list(
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data_iterator,
            model=chunks,
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            decoder_seq_length=decoder_seq_length,
            forward_only=True,
            collect_non_loss_data=True,
        )
    )


def token_log_probs(
    *,
    temperature: float = 1.0,
    tp_group: Any = None,
    with_entropy: bool = False,
    vocab_size: int | None = None,
    invariant: bool | None = None,
    config: Any = None,
) -> Collect:
    """A `collect` for inference_forward: log p(target) per token from logits [..., V_local]
    and the targets the forward step returned as `extra` (same leading shape); returns
    {"log_probs": [...], "entropy": [...] or None} via ops.logprobs.log_probs_and_entropy.
    `invariant`: the op's mode, resolved here once (None: the setting MEGATRON_RL_PATCHES_INVARIANT,
    else `config`'s batch_invariant_mode: the model's config, or the student's for a teacher)."""
    invariant = resolve_invariant(invariant, config)

    def collect(logits: torch.Tensor, targets: Any) -> dict[str, torch.Tensor | None]:
        if not isinstance(targets, torch.Tensor):
            raise TypeError(
                "token_log_probs needs the target token ids: make forward_step_func return "
                f"(logits, targets), got extra={type(targets).__name__}"
            )
        if tuple(logits.shape[:-1]) != tuple(targets.shape):
            raise ValueError(
                f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} must share their "
                "leading dimensions (logits carry one more: the vocab)"
            )
        log_probs, entropy = log_probs_and_entropy(
            logits.reshape(-1, logits.shape[-1]),
            targets.reshape(-1),
            tp_group=tp_group,
            temperature=temperature,
            with_entropy=with_entropy,
            vocab_size=vocab_size,
            invariant=invariant,
        )
        shape = targets.shape
        return {"log_probs": log_probs.view(shape), "entropy": None if entropy is None else entropy.view(shape)}

    return collect
