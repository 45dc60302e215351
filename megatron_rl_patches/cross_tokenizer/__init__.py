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

from megatron_rl_patches._lazy import lazy_getattr, lazy_names

# module: the public names it defines (each resolved on first access)
_LAZY = lazy_names("""
    loading: load_tokenizer
    spelling: token_bytes
    alignment: Alignment align
    retokenizing: retokenize
    vocabulary: SharedVocabulary shared_vocabulary shared_strings
    spreading: spread_chunk_log_probs
    losses: chunk_reverse_kl chunk_start_topk_divergence chunk_start_full_divergence
    # a teacher with another tokenizer scored by a training loop's own passes
    teacher: CrossTeacher cross_teacher
    teacher_passes: TeacherSample teacher_sample split_micro_batches PassBatches pass_batches Buckets
        chunk_start_buckets teacher_buckets_on_student_rows log_ratio
    chunk_terms: chunk_distillation_terms masked_tail
""")

__all__ = sorted(_LAZY)

# the names before each said its kind (issue 113: "plan" is a shared-prefix plan or a ScoringPlan)
RENAMED = {"PassPlan": "PassBatches", "plan_passes": "pass_batches", "plan_micro_batches": "split_micro_batches"}

__getattr__ = lazy_getattr(__name__, _LAZY, globals(), RENAMED)


def __dir__() -> list[str]:
    return __all__
