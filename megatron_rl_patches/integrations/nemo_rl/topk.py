"""`nemo_rl_topk`: NeMo-RL's `TopkLogitsPostProcessor` (the teacher's `get_topk_logits`) on the
package's top-k, with no [T, V] logits.

NeMo-RL 7ea279ab's own processor returns each token's k largest logits (`topk_logits`) and their
ids (`topk_indices`), [B, S, k], from the full [b, s, V/tp] logits. Here the ids are the same top-k
(selected from the hidden states, chunk by chunk) and `topk_logits` holds their log-probs over the
teacher's whole vocabulary: NeMo-RL's own distillation loss renormalizes them over the k ids
(`log_softmax`), which gives what it gives from the logits, and `nemo_rl_topk_kd` reads the
teacher's tail (the mass outside its top-k) from them. Layouts as `nemo_rl_fused_logprobs`
(packed sequences gathered over context parallelism, as NeMo-RL's own processor does).
"""
# lazy imports: optional dependency nemo_rl
from __future__ import annotations

from typing import Any

import torch

from megatron_rl_patches.integrations.nemo_rl import step as steps
from megatron_rl_patches.model.arguments import bind
from megatron_rl_patches.processors.heads import topk_output_processor

PATCH = "nemo_rl_topk"


def _topk_function(plan: steps.ProcessorStep, original: Any) -> Any:
    def processor_fn_inner(output: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        layout = plan.layout
        assert layout is not None
        lengths = layout.microbatch.data_dict["input_lengths"] if layout.packed else None
        values = layout.unpacked(output["topk_log_probs"], layout.seq_len, lengths=lengths)
        ids = layout.unpacked(output["topk_ids"], layout.seq_len, lengths=lengths)
        return values.new_zeros(()), {"topk_logits": values, "topk_indices": ids}

    return processor_fn_inner


def forward_step_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for `nemo_rl_topk` on NeMo-RL's `forward_with_post_processing_fn`."""
    from nemo_rl.models.megatron.train import TopkLogitsPostProcessor  # lazy: optional dependency nemo_rl

    bound = bind(wrapped, args, kwargs)
    if bound is None or not isinstance(bound.arguments["post_processing_fn"], TopkLogitsPostProcessor):
        return wrapped(*args, **kwargs)
    post = bound.arguments["post_processing_fn"]
    feature = steps.unservable(bound.arguments, post.cfg)
    if feature is not None:
        steps.fall_back(PATCH, feature)
        return wrapped(*args, **kwargs)
    temperature = steps.temperature_of(bound.arguments)
    plan = steps.ProcessorStep(topk_output_processor(k=int(post.k), temperature=temperature,
                                                chunk_size=steps.chunk_size_of(post.cfg)), temperature,
                          bool(post.cfg["sequence_packing"]["enabled"]))
    return steps.run_step(wrapped, bound, plan, _topk_function)
