"""GPTModel's `output_processor=` / `output_processor_context=` keywords (megatron-core >= 0.18)
backported to releases before 0.18: the wrapper of patch `gpt_output_processor` (declared in
`megatron_rl_patches.integrations.megatron.patches`; the signature it shows is `gpt_signature`'s).
The work is `backport_common.forward_with_processor`, shared with HybridModel's `hybrid_output_processor`."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches.processors.backport_common import forward_with_processor


def gpt_forward_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """`gpt_output_processor`: the processor gets the output layer's inputs in place of the logits
    and its result is returned, with the keywords megatron-core 0.18 passes."""
    return forward_with_processor(wrapped, instance, args, kwargs)
