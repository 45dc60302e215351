"""slime's own layers as shared-prefix model kinds, registered at slime's shared-prefix door
(`fused_step.slime_prefix_pass`) before the plan reads the model: its gated delta net layers, which a
plan runs (`gated_delta_net`), and its GLM-5 DSA layer (slime_plugins/models/glm5), refused by name."""
from __future__ import annotations

from megatron_rl_patches.integrations.slime.gated_delta_net import SlimeGatedDeltaNet
from megatron_rl_patches.shared_prefix.kinds import register
from megatron_rl_patches.shared_prefix.kinds.kind import Continuation, RefusedByName

# the layers by their hf_forward (`is_slime_gated_delta_net`); their linear attention and its convolution by these
SLIME_GATED_DELTA_NET = SlimeGatedDeltaNet("slime's gated delta net layer", classes=(
    "slime_plugins.models.qwen3_5:Qwen3_5GatedDeltaNet", "slime_plugins.models.qwen3_next:Qwen3NextGatedDeltaNet",
    "fla.modules:ShortConvolution"), continuation=Continuation(along_rows=True, held_reason=(
        "slime's gated delta net layer: it does not hand a held segment's state on yet")))
GLM5_SPARSE_ATTENTION = RefusedByName(
    "slime's GLM-5 DSA layer (its indexer and sparse MLA are tilelang CUDA kernels taking one contiguous key range "
    "[start, end) per query from cu_seqlens, where a planned row sees its ancestors' rows and its own)",
    named="DSAMultiLatentAttention")


def register_model_kinds() -> None:
    """slime's kinds, known to the plan from now on (idempotent)."""
    register(SLIME_GATED_DELTA_NET)
    register(GLM5_SPARSE_ATTENTION)
