"""What top-k OPD asks of a pass and writes into the rollout data, for any Megatron host: the
request a fused model call answers beside the log-probs (`TopkRequest`; `VocabRequest` for
full-vocabulary OPD) and the per-sample rollout-data keys the teachers fill and the student's
training step reads (slime's step carries them in its batches: `integrations.slime.fused_step`)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TopkRequest:
    """Top-k buckets asked of the fused call beside the log-probs: the student's own top-`k` ids,
    or the ids in the batch's per-sample `ids_key` ([R, k] each) scored (padded where the
    per-sample bool `mask_key` is False), or with `union` its own top-`k` joined to those ids
    (`union_ids`); `keys` are the per-sample batch keys the step needs beyond slime's own."""

    k: int | None = None
    ids_key: str | None = None
    keys: tuple[str, ...] = ()
    mask_key: str | None = None
    union: bool = False


# The per-sample keys top-k OPD adds to slime's rollout data: the ids scored ([R, k], or [R, 2k]
# with their padding mask for a union), and per teacher the scores [n, R, k] and tails [n, R].
IDS, TEACHER_LOGPROBS, TEACHER_TAILS = "opd_topk_ids", "opd_teacher_logprobs", "opd_teacher_tails"
IDS_MASK = "opd_topk_ids_mask"
# Teachers with another tokenizer (`cross_passes`): per sample, the ids the student's step scores (the
# same-tokenizer ids, then each such teacher's bucket ids; [R, K] with their mask), and per such
# teacher the token-level log-ratio [R, n], bucket scores [R, n, k], tails [R, n], live buckets [R, n, k].
STEP_IDS, STEP_MASK = "opd_step_ids", "opd_step_ids_mask"
# per sample [R, K] int64: a slot whose id an earlier slot of its row holds, that column (else -1;
# `step_repeats`: scored once, masked in STEP_MASK)
STEP_SAME_AS = "opd_step_same_as"
CROSS_RATIO, CROSS_LOGPROBS = "opd_cross_log_ratio", "opd_cross_teacher_logprobs"
CROSS_TAILS, CROSS_ALIVE = "opd_cross_teacher_tails", "opd_cross_alive"
# per sample [n] int64 on the host: the places in MEGATRON_RL_PATCHES_OPD_TEACHERS of the teachers
# whose buckets are grouped (another tokenizer), in the order of the CROSS_* fields' columns
CROSS_TEACHERS = "opd_cross_teachers"
CROSS_KEYS = (STEP_IDS, STEP_MASK, STEP_SAME_AS, CROSS_RATIO, CROSS_LOGPROBS, CROSS_TAILS, CROSS_ALIVE, CROSS_TEACHERS)
OPD_KEYS = (IDS, IDS_MASK, TEACHER_LOGPROBS, TEACHER_TAILS, *CROSS_KEYS)

# Full-vocabulary OPD (MEGATRON_RL_PATCHES_OPD_K=vocab, `vocab_opd`): per sample a tuple with each
# teacher's final hidden states [R, H_j] on this rank's response rows (slime's zigzag rows), and the
# teachers' output layers (`hidden_teachers.TeacherHeads`, the same object for every sample: a reference).
TEACHER_HIDDEN, TEACHER_HEADS = "opd_teacher_hidden", "opd_teacher_heads"
VOCAB_KEYS = (TEACHER_HIDDEN, TEACHER_HEADS)
# each sample's privileged contexts ({KEY: text or ids}, one per sample), carried to the training ranks
CONTEXTS = "megatron_rl_patches_contexts"
# the rollout data's key of the samples' own train_metadata (a list of dicts, slime's), kept out of its metrics too
METADATA = "metadata"
# the train step's served teachers' figures (`served_opd.note_figures`: one dict, on the last stage)
FIGURES = "opd_teacher_figures"
# the fields above no framework's metrics may average (ids, masks, [n, R, k] scores, per-sample dicts)
NOT_METRICS = (*OPD_KEYS, *VOCAB_KEYS, CONTEXTS, METADATA, FIGURES)


@dataclass(frozen=True)
class VocabRequest(TopkRequest):
    """Full-vocabulary OPD's part of a fused call (`fused_context.vocab_processor`). `hidden`: a teacher's pass giving
    its final hidden states (its output weight kept once per pass in `captured`); else the training
    step's: the per-token `divergence` between the student and the teachers of the batch's keys,
    mixed with `weights` (None: equal)."""

    hidden: bool = False
    divergence: str = "reverse_kl"
    weights: tuple[float, ...] | None = None
    captured: list = field(default_factory=list, compare=False, hash=False, repr=False)

