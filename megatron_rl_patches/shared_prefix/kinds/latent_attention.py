"""Multi-latent attention (megatron-core's `MultiLatentAttention`, and 0.19's absorbed MLA that DSA
runs in): its own rotary table, built from a length, answers a plan's length with the table at each
row's own position (`mla.prepare_latent_attention`). Refused by name on megatron-core before 0.16
(its MLA fails inside its own rotary step on packed input); its config fields are its own."""
from __future__ import annotations

import functools
import re
from typing import Any

from megatron_rl_patches.model.kinds import qualified_name
from megatron_rl_patches.shared_prefix.kinds.fields import checked, per_token, rows
from megatron_rl_patches.shared_prefix.kinds.kind import ByCode
from megatron_rl_patches.shared_prefix.mla import is_latent_attention, prepare_latent_attention


@functools.cache
def megatron_core_before_0_16() -> str | None:
    """megatron-core's version where it is older than 0.16 (its multi-latent attention fails inside its own
    rotary step on packed input, checked on 0.13.1), else None."""
    try:
        from megatron.core.package_info import __version__  # lazy: optional dependency megatron-core
    except ImportError:
        return None
    found = re.match(r"(\d+)\.(\d+)", str(__version__))
    return str(__version__) if found and (int(found[1]), int(found[2])) < (0, 16) else None


class LatentAttention(ByCode):
    def reason(self, module: Any, path: str) -> str | None:
        if not (is_latent_attention(module) and megatron_core_before_0_16()):
            return None
        return (f"multi-latent attention on megatron-core {megatron_core_before_0_16()} "
                f"({qualified_name(type(module))} at {path}): tested exact on 0.16 and later; upgrade megatron-core "
                "or do not share this model's prefixes")

    def prepare(self, module: Any) -> bool:
        if not is_latent_attention(module):
            return False
        prepare_latent_attention(module)
        return True


LATENT_ATTENTION = LatentAttention("multi-latent attention", classes=(
    "megatron.core.transformer.multi_latent_attention:MultiLatentAttention",
    "megatron.core.transformer.experimental_attention_variant.absorbed_mla:AbsorbedMLASelfAttention",
), fields=rows({
    "multi_latent_attention": checked(
        "False; True without fused or interleaved RoPE (tested at 1 rank, TP = 2, TP = 2 + SP, PP = 2)",
        lambda value, s, training: not value or (not s.get("apply_rope_fusion") and not s.get("rotary_interleaved")),
        what="multi-latent attention with fused or interleaved RoPE",
        why="its rotary table is read at each token's own position only on the unfused, non-interleaved path; set "
            "apply_rope_fusion=False and rotary_interleaved=False"),
}, {per_token("only with multi_latent_attention, which is refused"): """q_lora_rank kv_lora_rank qk_head_dim
        qk_pos_emb_head_dim v_head_dim rope_type rotary_base rotary_percent rotary_scaling_factor
        original_max_position_embeddings beta_fast beta_slow mscale mscale_all_dim mla_down_proj_fusion"""}))
