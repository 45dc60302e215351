"""`nemo_rl_fused_logprobs`: NeMo-RL's log-probs from the fused LM head, with no [T, V] logits.

Two post-processors of NeMo-RL 7ea279ab's train.py are served: `LogprobsPostProcessor`
(`get_logprobs`, the reference policy) returns {"logprobs": [B, S]} (0 first, then log p of each
next token) as NeMo-RL's `from_parallel_logits_to_logprobs[_packed_sequences]` does, at every
layout its code runs (tensor / sequence / pipeline parallelism, packed sequences, context
parallelism); `LossPostProcessor` with a log-prob loss (`ClippedPGLossFn` for GRPO, `NLLLossFn`)
gets those next-token log-probs [B, S−1] with their gradient through NeMo-RL's own loss wrapper,
normalization and CP / micro-batch scaling (a copy of the post-processor with a `prepare_fn` that
hands them over; packed micro-batches as one unpacked batch: the same token-level sums).
"""
# lazy imports: optional dependency nemo_rl
from __future__ import annotations

import copy
from typing import Any

import torch

from megatron_rl_patches.integrations.nemo_rl import step as steps
from megatron_rl_patches.model.arguments import bind
from megatron_rl_patches.processors.heads import log_prob_output_processor

PATCH = "nemo_rl_fused_logprobs"


def next_token_logprobs(plan: steps.ProcessorStep, output: Any) -> torch.Tensor:
    """[B, S−1] log p(next token) from the processor's [b, s_local] log-probs, NeMo-RL's layout."""
    layout = plan.layout
    assert layout is not None  # the model ran
    seq_len = layout.seq_len
    return layout.unpacked(output["log_probs"], seq_len - 1)


def _logprobs_function(plan: steps.ProcessorStep, original: Any) -> Any:
    def processor_fn_inner(output: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        values = next_token_logprobs(plan, output).to(torch.float32)
        values = torch.cat([torch.zeros_like(values[:, :1]), values], dim=1)
        return torch.tensor(0.0, device=values.device), {"logprobs": values}

    return processor_fn_inner


def prepare_logprob_input(*, logits: Any, data: Any, **_ignored: Any) -> tuple[dict[str, Any], Any]:
    """A `prepare_fn` for NeMo-RL's loss wrapper: the fused output's next-token log-probs."""
    return {"next_token_logprobs": logits["next_token_logprobs"]}, data


def unpacked_loss_processor(post_processor: Any, prepare_fn: Any, loss_fn: Any = None) -> Any:
    """A copy of NeMo-RL's `LossPostProcessor` that wraps its loss over one unpacked batch with
    `prepare_fn` (and, given, another loss function); the caller's object is left as it is."""
    shadow = copy.copy(post_processor)
    packing = dict(post_processor.cfg["sequence_packing"], enabled=False)
    shadow.cfg = {**post_processor.cfg, "sequence_packing": packing}
    shadow.prepare_fn = prepare_fn
    if loss_fn is not None:
        shadow.loss_fn = loss_fn
    return shadow


def loss_function(plan: steps.ProcessorStep, arguments: dict, prepare_fn: Any, values: Any, loss_fn: Any = None) -> Any:
    """NeMo-RL's loss chain (its wrapper, normalization, CP and micro-batch scaling) for this
    step, reading `values(plan, output)` in place of logits."""
    layout = plan.layout
    assert layout is not None
    shadow = unpacked_loss_processor(arguments["post_processing_fn"], prepare_fn, loss_fn)
    chain = shadow(data_dict=layout.microbatch.data_dict, packed_seq_params=None,
                   global_valid_seqs=arguments["global_valid_seqs"], global_valid_toks=arguments["global_valid_toks"])

    def loss_fn_wrapped(output: Any) -> Any:
        return chain(steps.FusedOutput(values(plan, output), plan.temperature))

    return loss_fn_wrapped


def forward_step_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for `nemo_rl_fused_logprobs` on NeMo-RL's `forward_with_post_processing_fn`."""
    from nemo_rl.algorithms.loss.interfaces import LossInputType  # lazy: optional dependency nemo_rl
    from nemo_rl.models.megatron.train import LogprobsPostProcessor, LossPostProcessor

    bound = bind(wrapped, args, kwargs)
    if bound is None:
        return wrapped(*args, **kwargs)
    arguments = bound.arguments
    post = arguments["post_processing_fn"]
    is_logprobs = isinstance(post, LogprobsPostProcessor)
    is_loss = isinstance(post, LossPostProcessor) and getattr(post.loss_fn, "input_type", None) == LossInputType.LOGPROB
    if not (is_logprobs or is_loss):
        return wrapped(*args, **kwargs)
    feature = steps.unservable(arguments, post.cfg)
    if feature is None and is_loss and post.prepare_fn is not None:
        feature = "a custom prepare_fn"
    if feature is None and is_loss and getattr(post, "d2t", None) is not None:
        feature = "a draft model's token map"
    if feature is not None:
        steps.fall_back(PATCH, feature)
        return wrapped(*args, **kwargs)
    temperature = steps.temperature_of(arguments)
    plan = steps.ProcessorStep(log_prob_output_processor(temperature=temperature,
                                                    chunk_size=steps.chunk_size_of(post.cfg)), temperature,
                          bool(post.cfg["sequence_packing"]["enabled"]))
    if is_logprobs:
        return steps.run_step(wrapped, bound, plan, _logprobs_function)

    def loss_post_process(plan: steps.ProcessorStep, original: Any) -> Any:
        return loss_function(plan, arguments, prepare_logprob_input,
                             lambda plan, output: {"next_token_logprobs": next_token_logprobs(plan, output)})

    return steps.run_step(wrapped, bound, plan, loss_post_process)
