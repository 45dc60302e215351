"""NeMo-RL (7ea279ab): its records (`patches`); a served teacher as its distillation teacher
(`served_teacher`: `served_teacher_policy`, `served_teacher_in_setup`); the live self-teacher, the
student's own policy over privileged contexts (`self_teacher`: `self_teacher_policy`,
`self_teacher_in_setup`); NeMo-RL's own teacher Policy over privileged contexts
(`privileged_teacher`: `privileged_teacher_policy`, `privileged_teacher_in_setup`), the three one
`TeacherPolicy` whose wrapped scorer is data, with one setup block (`teacher_policy`, over NeMo-RL's
batch as its teacher reads it: `teacher_rows`); its Megatron driver's
log-prob route on the fused head (`logprobs`), its teacher top-k on the package's top-k (`topk`)
and its top-k distillation loss as the exact (k+1)-bucket divergence (`topk_kd`), each through one
forward step (`step`) and NeMo-RL's own row layouts (`rows`); every Megatron pass computing a group's
shared prompt once with MEGATRON_RL_PATCHES_SHARED_PREFIX=1 (`shared_prefix`)."""
from __future__ import annotations

from megatron_rl_patches._lazy import lazy_getattr, lazy_names

# loaded on first use: the records (`patches`) are read without the teachers' client
_LAZY = lazy_names("""
    served_teacher: ServedTeacherPolicy served_teacher_policy served_teacher_in_setup
    self_teacher: StudentPolicyPass self_teacher_policy self_teacher_in_setup
    privileged_teacher: PrivilegedTeacherPolicy privileged_teacher_policy privileged_teacher_in_setup
""")
__all__ = sorted(_LAZY)
__getattr__ = lazy_getattr(__name__, _LAZY, globals())
