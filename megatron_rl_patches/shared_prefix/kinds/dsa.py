"""megatron-core 0.19's DeepSeek sparse attention (DSA): its core attention (`DSAttention`) takes the
plan's rule as its mask and its indexer's rotary table reads each row's own position
(`sparse_attention.prepare_sparse_attention`, on the core); the indexer (`DSAIndexer`) is prepared
with its core. Refused by name on megatron-core before 0.19 (`sparse_attention.module_reason`) and,
by its config fields, what `sparse_attention_refusal` names."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_rl_patches.shared_prefix.kinds.fields import UNTESTED, Known, checked, per_token, rows, zero
from megatron_rl_patches.shared_prefix.kinds.kind import ByCode, Continuation, loaded_class, owner
from megatron_rl_patches.shared_prefix.prepared import own_class
from megatron_rl_patches.shared_prefix.sparse_attention import module_reason, prepare_sparse_attention

CORE = "megatron.core.transformer.experimental_attention_variant.dsa:DSAttention"
INDEXER = "megatron.core.transformer.experimental_attention_variant.dsa:DSAIndexer"


def _dsa(exact: str, test: Callable[[Any], bool], what: str, why: str) -> Known:
    """A DSA setting: inert without DSA; with it, `test`."""
    return checked(exact, lambda value, s, training: s.get("experimental_attention_variant") != "dsa" or test(value),
                   what=what, why=why)


class SparseAttention(ByCode):
    def is_core(self, module: Any) -> bool:
        core = loaded_class(CORE)
        return core is not None and owner(own_class(type(module)), "forward") is core

    def reason(self, module: Any, path: str) -> str | None:
        return module_reason(module, path) if self.is_core(module) else None

    def prepare(self, module: Any) -> bool:
        if not self.is_core(module):
            return False  # the indexer: its core prepares it
        prepare_sparse_attention(module)
        return True


SPARSE_ATTENTION = SparseAttention("DSA sparse attention", classes=(CORE, INDEXER), continuation=Continuation(
    held_reason="DSA sparse attention: its indexer's keys are not held yet"), fields=rows({
    "dsa_indexer_loss_coeff": checked(
        "None or 0 in training; any in forward-only passes",
        lambda value, s, training: not training or zero(value) or s.get("experimental_attention_variant") != "dsa",
        what="DSA's indexer loss in training",
        why="megatron-core averages the indexer's KL over the stream's query rows, where a shared prefix row would "
            "count once instead of once per sample that holds it; set dsa_indexer_loss_coeff=0 (or train the indexer "
            "without a sharing plan)"),
    "dsa_kernel_backend": _dsa("'none'", lambda value: (value or "none") == "none", "DSA's fused kernels",
                               "they take one contiguous key range per query, and a planned row sees its ancestors' "
                               "rows and its own; set dsa_kernel_backend='none'"),
    "dsa_indexer_topk_freq": _dsa("1", lambda value: int(value or 1) == 1, "DSA's top-k shared across layers",
                                  UNTESTED),
    "dsa_indexer_rope_interleaved": _dsa("False", lambda value: not value, "DSA's indexer with interleaved RoPE",
                                         UNTESTED),
}, {
    per_token("the widths of a gated delta net or of DSA's indexer, its top-k and its per-token scoring (exact under "
              "the plan's rule; top-k ties broken by stream order, as in any packing)"): """dsa_indexer_n_heads
        dsa_indexer_head_dim dsa_indexer_topk dsa_indexer_rotate_activation dsa_indexer_scoring_relu
        dsa_indexer_k_norm_epsilon dsa_indexer_k_norm_fp32""",
    per_token("only with DSA's indexer loss or top-k sharing, which are refused"): """dsa_indexer_use_sparse_loss
        dsa_indexer_skip_topk_offset""",
}))
