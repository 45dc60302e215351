"""Every NeMo-RL record in one place (NeMo-RL 7ea279ab, `nemo_rl/models/megatron/train.py`):
`nemo_rl_fused_logprobs` (`logprobs`), `nemo_rl_topk` (`topk`) and `nemo_rl_topk_kd` (`topk_kd`)
wrap the forward step NeMo-RL's `megatron_forward_backward` hands Megatron's schedule, each acting
only on its own post-processor (the others pass through); `nemo_rl_shared_prefix` (`shared_prefix`)
wraps `megatron_forward_backward` (each pass's door) and the same forward step, and does nothing
unless MEGATRON_RL_PATCHES_SHARED_PREFIX is on. NeMo-RL ships no version
metadata: the parameter list is the guard. Every record is a no-op until train.py is imported."""
from __future__ import annotations

from megatron_rl_patches.patching.records import Patch

HERE = "megatron_rl_patches.integrations.nemo_rl"
STEP = "nemo_rl.models.megatron.train:forward_with_post_processing_fn"
DRIVER = "nemo_rl.models.megatron.train:megatron_forward_backward"
DRIVER_PARAMS = ("model", "data_iterator", "num_microbatches", "seq_length", "mbs", "post_processing_fn",
                 "forward_only")
STEP_PARAMS = ("data_iterator", "model", "post_processing_fn", "defer_fp32_logits", "global_valid_seqs",
               "global_valid_toks", "sampling_params")


def _step(name: str, wrapper: str, description: str) -> Patch:
    return Patch(name=name, target=STEP, wrapper=f"{HERE}.{wrapper}", description=description, requires=None,
                 params=STEP_PARAMS)


PATCHES = (
    _step("nemo_rl_fused_logprobs", "logprobs:forward_step_wrapper",
          "NeMo-RL's log-prob post-processor and log-prob losses (GRPO's ClippedPGLossFn, NLL) on the fused "
          "LM head: per-token log-probs from the hidden states, no [T, V] logits"),
    _step("nemo_rl_topk", "topk:forward_step_wrapper",
          "NeMo-RL's top-k logits post-processor (the teacher's get_topk_logits) on the package's top-k: "
          "log-probs over the whole vocabulary, no [T, V] logits"),
    _step("nemo_rl_topk_kd", "topk_kd:forward_step_wrapper",
          "NeMo-RL's top-k distillation loss as the exact (k+1)-bucket divergence with both tails, on the fused head"),
    Patch(name="nemo_rl_shared_prefix", target=DRIVER, wrapper=f"{HERE}.shared_prefix:forward_backward_wrapper",
          description="with MEGATRON_RL_PATCHES_SHARED_PREFIX=1, each pass of NeMo-RL's Megatron policy (training, "
                      "log-probs, reference, teacher top-k) decides at its door whether its model runs a "
                      "shared-prefix plan", requires=None, params=DRIVER_PARAMS),
    _step("nemo_rl_shared_prefix", "shared_prefix:forward_step_wrapper",
          "each packed micro-batch of such a pass computes its samples' shared leading tokens once"),
)
