"""Mamba layers (megatron-core's `MambaMixer`, by its class's name): refused, since each remainder
would start from the prefix's final state, which no seam hands on yet. Their config fields take any
value: the layers themselves are refused."""
from __future__ import annotations

from megatron_rl_patches.shared_prefix.kinds.fields import per_token, rows
from megatron_rl_patches.shared_prefix.kinds.kind import Continuation, RefusedByName

MAMBA = RefusedByName(
    "Mamba layers (each remainder would start from the prefix's final state)", named="MambaMixer",
    continuation=Continuation(along_rows=True),
    fields=rows({}, {per_token("Mamba and gated delta net layers are refused by their class"): """mamba_state_dim
        mamba_head_dim mamba_num_groups mamba_num_heads use_mamba_mem_eff_path mamba_training_ssm_states_dtype"""}))
