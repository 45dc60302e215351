"""HybridModel's (and MambaModel's) `output_processor=` / `output_processor_context=` keywords, as
GPTModel's forward has them on megatron-core >= 0.18: the wrapper of patch `hybrid_output_processor`
(declared in `megatron_rl_patches.integrations.megatron.patches`). The work is
`backport_common.forward_with_processor`, shared with GPTModel's backport."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches.processors.backport_common import forward_with_processor


def hybrid_forward_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """`hybrid_output_processor`: the processor gets the output layer's inputs in place of the
    logits and its result is returned, with the keywords megatron-core 0.18 passes."""
    return forward_with_processor(wrapped, instance, args, kwargs)
