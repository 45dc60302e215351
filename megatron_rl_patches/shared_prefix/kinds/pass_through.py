"""The modules that hand `packed_seq_params` on, unread, or never get them though their forward
could (`**kwargs`): megatron-core's transformer block and layer, the Mamba and hybrid stacks, its
identity ops and MLP. Each runs its own forward under a plan, and what it builds in its `__init__`
is each a module of its own, recognized (or refused) by its own kind; nothing to prepare."""
from __future__ import annotations

from megatron_rl_patches.shared_prefix.kinds.kind import ByCode

PASS_THROUGH = ByCode("module passing the sequences on", classes=(
    "megatron.core.transformer.transformer_block:TransformerBlock",
    "megatron.core.transformer.transformer_layer:TransformerLayer",
    "megatron.core.ssm.mamba_block:MambaStack",
    "megatron.core.models.hybrid.hybrid_block:HybridStack",
    "megatron.core.transformer.identity_op:IdentityOp",
    "megatron.core.transformer.identity_op:IdentityFuncOp",
    "megatron.core.transformer.mlp:MLP",
))
