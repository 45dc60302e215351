"""slime (624b824a): its records (`patches`), and the modules that do the work: the log-prob
adapter (`logprobs`), inference-only roles (`roles`), the fused route (`fused`, slicing with
slime's helpers in `rows`, top-k buckets in `topk`), the step plan both the fused route and top-k
OPD use (`fused_step`) and top-k OPD (`opd`; its teachers live on megatron-core in
`megatron_rl_patches.integrations.megatron.opd`, handed slime's actor as `actor.SlimeActor`;
the fields and loss terms of teachers with another tokenizer in `cross_loss`).

`megatron_rl_patches.integrations.slime.calculate_log_probs_and_entropy` (a path users type) is
the adapter's function."""
from __future__ import annotations

from megatron_rl_patches import _aliases
from megatron_rl_patches._lazy import lazy_getattr, lazy_names

_LAZY = lazy_names("""
    logprobs: calculate_log_probs_and_entropy calculate_log_probs_and_entropy_wrapper
""")
__all__ = sorted(_LAZY)
__getattr__ = lazy_getattr(__name__, _LAZY, globals())

# the step plan's module before it was named for what it holds (issue 45); the slime-free part of
# the teachers with another tokenizer, moved to the cross_tokenizer package (issue 56); the
# in-process teachers, moved to their megatron-core home (issue 73; slime's host.py: stage_host)
_HOME = "megatron_rl_patches.integrations.megatron.opd"
# `step_plan`: the fused step's module, named for what it holds (issue 113); `vocab_step`: moved (issue 122)
_aliases.install(__name__, {"plan": "megatron_rl_patches.integrations.slime.fused_step",
                            "step_plan": "megatron_rl_patches.integrations.slime.fused_step",
                            "cross_teachers": "megatron_rl_patches.cross_tokenizer.teacher_passes",
                            "vocab_step": f"{_HOME}.fused_context",
                            "host": f"{_HOME}.stage_host", **{name: f"{_HOME}.{name}" for name in (
                                "actor_spec", "cross_passes", "cross_rollout", "expert_agreement", "hf_teachers",
                                "layout_role", "layout_role_pass", "layout_teacher", "opd_settings", "opd_teachers",
                                "served_opd", "served_teacher", "teacher_builders")}})
