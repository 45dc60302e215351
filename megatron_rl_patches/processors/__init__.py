"""Output processors for megatron-core's GPTModel and HybridModel (`output_processor=`), on every
supported version: the log-prob and top-k heads (`heads`), the distillation ones (`distill`), several
run in one call (`combined`), a rollout's top-p nuclei as the kept-set context (`nucleus`), the
keyword's backport (`backport_common`, the shared forward; the wrappers `gpt_backport` and
`hybrid_backport`; `gpt_signature`; patches `gpt_output_processor`
for GPTModel before 0.18 and `hybrid_output_processor`), and the MTP heads' loss through the
fused head (`mtp_loss`; patch `mtp_output_processor`)."""
from __future__ import annotations

from megatron_rl_patches import _aliases
from megatron_rl_patches._lazy import lazy_getattr, lazy_names

_LAZY = lazy_names("""
    heads: log_prob_output_processor topk_output_processor
    distill: hidden_output_processor divergence_output_processor
""")
__all__ = sorted(_LAZY)
__getattr__ = lazy_getattr(__name__, _LAZY, globals())

# the shared forward's module before the backports were named for their models (issue 45)
_aliases.install(__name__, {"backport": "megatron_rl_patches.processors.backport_common"})
