"""Multi-token prediction: megatron-core's `MultiTokenPredictionBlock` and its layers. The block is
prepared (`mtp.prepare_mtp_block`: each depth's layer runs a stream of its own plan, the prompt
shared one token shorter per depth); its layers run their own forward under their depth's plan."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches.shared_prefix.kinds.fields import checked, per_token, rows
from megatron_rl_patches.shared_prefix.kinds.kind import ByCode, Continuation, loaded_class, owner
from megatron_rl_patches.shared_prefix.mtp import prepare_mtp_block
from megatron_rl_patches.shared_prefix.prepared import own_class

BLOCK = "megatron.core.transformer.multi_token_prediction:MultiTokenPredictionBlock"


class MultiTokenPrediction(ByCode):
    def prepare(self, module: Any) -> bool:
        block = loaded_class(BLOCK)
        if block is None or owner(own_class(type(module)), "forward") is not block:
            return False  # a layer: its block prepares it
        prepare_mtp_block(module)
        return True


MULTI_TOKEN_PREDICTION = MultiTokenPrediction("multi-token prediction", classes=(
    BLOCK, "megatron.core.transformer.multi_token_prediction:MultiTokenPredictionLayer",
), continuation=Continuation(held_reason="MTP: its depths' streams hold no segment yet"), fields=rows({
    "mtp_num_layers": checked(
        "None, 0; 1 or 2 (tested at 1 rank, TP = 2, TP = 2 + SP, PP = 2, CP = 2 x TP = 2 + SP, CP = 2 x PP = 2)",
        lambda value, s, training: not value or int(value) <= 2,
        what="multi-token prediction at this depth",
        why="each depth runs its own stream (the prompt shared one token shorter per depth), tested at depths 1 "
            "and 2; run it there or do not share this model's prefixes"),
}, {per_token("only with mtp_num_layers, which is refused"):
    "mtp_standalone mtp_use_repeated_layer mtp_detach_heads mtp_hybrid_override_pattern"}))
