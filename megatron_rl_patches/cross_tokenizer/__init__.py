"""Distillation from a teacher with another tokenizer: the exact bytes of every token, the
teacher's own encoding of the student's bytes, byte-exact chunks common to both tokenizations,
the per-token teacher signal spread over each chunk, the shared vocabulary, the losses for
hand-written loops, and what a loop that runs the teacher's passes itself needs (the teacher's
samples and micro-batches, its chunk-start buckets brought back to the student's rows, the
per-token terms): docs/distillation.md, "Teachers with another tokenizer".

Needs the optional `tokenizers` library (``pip install tokenizers``, or from a clone of this repository
``pip install -e '.[cross-tokenizer]'``);
importing this package imports nothing until a public name is first used."""
from __future__ import annotations

from megatron_rl_patches._lazy import lazy_getattr

# public name -> module that defines it (resolved on first access)
_LAZY = {
    "load_tokenizer": "loading",
    "token_bytes": "spelling",
    "Alignment": "alignment",
    "align": "alignment",
    "retokenize": "retokenizing",
    "SharedVocabulary": "vocabulary",
    "shared_vocabulary": "vocabulary",
    "shared_strings": "vocabulary",
    "spread_chunk_log_probs": "spreading",
    "chunk_reverse_kl": "losses",
    "chunk_start_topk_divergence": "losses",
    "chunk_start_full_divergence": "losses",
    # a teacher with another tokenizer scored by a training loop's own passes
    "CrossTeacher": "teacher",
    "cross_teacher": "teacher",
    "TeacherSample": "teacher_passes",
    "teacher_sample": "teacher_passes",
    "plan_micro_batches": "teacher_passes",
    "PassPlan": "teacher_passes",
    "plan_passes": "teacher_passes",
    "Buckets": "teacher_passes",
    "chunk_start_buckets": "teacher_passes",
    "teacher_buckets_on_student_rows": "teacher_passes",
    "log_ratio": "teacher_passes",
    "chunk_distillation_terms": "chunk_terms",
    "masked_tail": "chunk_terms",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY, globals())


def __dir__() -> list[str]:
    return __all__
