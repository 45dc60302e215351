"""Top-k OPD's teachers with another tokenizer on megatron-core: their loading (the two tokenizers
and the shared vocabulary: `cross_tokenizer.CrossTeacher`) and `CrossTokenizerTeacher`, the OPD
teacher wrapping a snapshot or a separate model whose two pipelined passes per step run over the
teacher's own packed rollout (its top-k ids and its own tokens' log-probs, then its bucket ids
scored; docs/distillation.md, "Teachers with another tokenizer"). The framework-free parts are in
`cross_tokenizer` (`teacher_passes`, `teacher`, `chunk_terms`); the teacher's rollout in the
rollout data's keys in `cross_rollout`; the fields the student's step reads and their loss terms
are the host's (slime: `integrations.slime.cross_loss`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl_patches.cross_tokenizer import teacher_passes as ct
from megatron_rl_patches.cross_tokenizer.loading import load_tokenizer
from megatron_rl_patches.cross_tokenizer.teacher import CrossTeacher
from megatron_rl_patches.cross_tokenizer.vocabulary import shared_strings
from megatron_rl_patches.integrations.megatron.opd import expert_agreement
from megatron_rl_patches.integrations.megatron.opd.cross_rollout import teacher_rollout
from megatron_rl_patches.integrations.megatron.opd.opd_settings import TEACHERS, Teacher, load_function
from megatron_rl_patches.integrations.megatron.opd.opd_teachers import (
    OpdTeacher,
    PassTeacher,
    ScoringStep,
    TeacherScores,
    model_teacher,
)
from megatron_rl_patches.integrations.megatron.opd.topk_request import CONTEXTS, TopkRequest
from megatron_rl_patches.integrations.megatron.opd.zigzag import whole_from_zigzag
from megatron_rl_patches.teachers.context.cross import cross_with_context

# the teacher rollout's keys of its second pass: its bucket ids per sample and their mask
TEACHER_IDS, TEACHER_MASK = "opd_cross_teacher_ids", "opd_cross_teacher_ids_mask"


def student_tokenizer(args: Any) -> Any:
    """The student's tokenizer: tokenizer.json in slime's --hf-checkpoint."""
    hf = getattr(args, "hf_checkpoint", None)
    if not isinstance(hf, str):
        raise ValueError(f"{TEACHERS}: a teacher with another tokenizer (';tokenizer=own', a served ';tokenizer=DIR') "
                         "needs the student's tokenizer: set slime's "
                         "--hf-checkpoint to the student's Hugging Face directory (its tokenizer.json)")
    try:
        return load_tokenizer(hf, "--hf-checkpoint")
    except ValueError as exc:
        raise ValueError(f"{TEACHERS}: a teacher with another tokenizer reads the student's tokenizer from "
                         f"--hf-checkpoint: {exc}") from None


def cross_pair(args: Any, teacher: Teacher) -> CrossTeacher:
    """Both tokenizers of a teacher with another tokenizer and their shared vocabulary: the
    student's (--hf-checkpoint) and the teacher's (`;tokenizer=own`: its directory's
    tokenizer.json; a served teacher's `;tokenizer=DIR`), its stop-token map."""
    student = student_tokenizer(args)
    path = teacher.path if teacher.tokenizer is None else teacher.tokenizer
    try:
        own = load_tokenizer(path, f"{TEACHERS}: teacher {teacher.path!r}")
    except ValueError as exc:
        option = "';tokenizer=own' reads the teacher's tokenizer.json" if teacher.tokenizer is None else \
            f"';tokenizer={teacher.tokenizer}' names the teacher's tokenizer"
        raise ValueError(f"{exc} ({option})") from None
    stop = None if teacher.stop_tokens is None else load_function(
        teacher.stop_tokens, "stop_tokens", "mapping a student special id to the teacher's id or None")
    return CrossTeacher(own, student, shared_strings(student, own), stop)


def load_cross(args: Any, teacher: Teacher, model: PassTeacher | str | list[Any]) -> CrossTokenizerTeacher:
    """`model` (a snapshot or a separate model, or any `PassTeacher`) as a teacher with its own
    tokenizer (`teacher.path`'s tokenizer.json)."""
    inner = model if isinstance(model, PassTeacher) else model_teacher(model)
    return CrossTokenizerTeacher(inner, cross_pair(args, teacher))


def context_of(rollout_data: dict, key: str) -> list[torch.Tensor]:
    """Every sample's context under `key` (the train_actor wrapper reads and agrees them first)."""
    contexts = rollout_data.get(CONTEXTS)
    if contexts is None:
        raise RuntimeError(f"slime_opd: a teacher of another tokenizer with ';context={key}' scores a rollout without "
                           "its contexts; please report this")
    return [one[key] for one in contexts]


def _whole(values: list[torch.Tensor], data: dict) -> list[torch.Tensor]:
    return whole_from_zigzag(values, list(data["total_lengths"]), list(data["response_lengths"]))


def teacher_samples(rollout_data: dict, pair: CrossTeacher) -> list[ct.TeacherSample]:
    """Every sample re-tokenized for the teacher of `pair` (on every rank: the pipeline stages pack
    the same; the teacher's ids on the device of the student's)."""
    return [pair.sample(tokens, int(response), mask)
            for tokens, response, mask in zip(rollout_data["tokens"], rollout_data["response_lengths"],
                                               rollout_data["loss_masks"])]


@dataclass(frozen=True)
class CrossTokenizerTeacher(OpdTeacher):
    """A teacher with another tokenizer: its `model` (a `PassTeacher`: a snapshot, a separate
    model) run on its own encoding of each sample (`pair`: both tokenizers and their shared
    vocabulary)."""

    model: PassTeacher
    pair: CrossTeacher
    context: str | None = None  # `;context=KEY`: each sample's context (the teacher's ids) before its response

    def score(self, step: ScoringStep) -> TeacherScores | None:
        """The teacher's two passes over its own rollout; on the last stage, per sample and whole:
        its bucket scores [R, k] and tails [R] on the student's rows, the student's bucket ids
        [R, k·D] and mask, the live buckets [R, k] and the log-ratio [R] (None on other stages)."""
        rollout_data, settings, last = step.rollout_data, step.settings, step.last
        run = self.model.passes(step)
        samples = teacher_samples(rollout_data, self.pair)
        if self.context is not None:  # the step's checked contexts (`step_contexts`), in the teacher's ids
            samples = cross_with_context(samples, context_of(rollout_data, self.context))
        budget = ct.student_budget(rollout_data["total_lengths"], rollout_data["micro_batch_indices"])
        lengths = [s.tokens.numel() for s in samples]
        # at least the student's count (a pipeline schedule's minimum); with expert parallelism as many
        # as every data-parallel rank's (the MoE dispatchers' collectives pair the ranks' forwards up)
        planned = len(ct.split_micro_batches(lengths, budget, len(rollout_data["micro_batch_indices"])))
        plan = ct.pass_batches(lengths, budget, expert_agreement.agreed_micro_batches(
            max(planned, len(rollout_data["micro_batch_indices"]))))
        own = teacher_rollout(samples, plan)
        first = run(own, TopkRequest(k=settings.top_k))
        buckets: list[ct.Buckets] = []
        if last:
            top = plan.unpadded(_whole(first["topk_ids"], own))
            buckets = [ct.chunk_start_buckets(ids, s.alignment, self.pair.shared) for ids, s in zip(top, samples)]
            own[TEACHER_IDS] = step.cut(plan.padded([b.teacher_ids for b in buckets]), own)
            own[TEACHER_MASK] = step.cut(plan.padded([b.teacher_mask for b in buckets]), own)
        second = run(own, TopkRequest(ids_key=TEACHER_IDS, mask_key=TEACHER_MASK, keys=(TEACHER_IDS, TEACHER_MASK)))
        if not last:
            return None
        own_log_probs = plan.unpadded(_whole(first["log_probs"], own))
        id_log_probs = plan.unpadded(_whole(second["topk_log_probs"], own))
        tails = plan.unpadded(_whole(second["tail"], own))
        out: dict[str, list[torch.Tensor]] = {key: [] for key in ("ratio", "logprobs", "tails", "alive", "ids",
                                                                  "mask")}
        for s, b, student, teacher_lp, lp, tail in zip(samples, buckets, step.student_log_probs, own_log_probs,
                                                       id_log_probs, tails):
            values, t_tails = ct.teacher_buckets_on_student_rows(lp, tail, b, s.alignment)
            out["ratio"].append(ct.log_ratio(student.float(), teacher_lp.float(), s.alignment))
            out["logprobs"].append(values.float())
            out["tails"].append(t_tails.float())
            out["alive"].append(b.alive)
            out["ids"].append(b.student_ids)
            out["mask"].append(b.student_mask)
        return TeacherScores(out["logprobs"], out["tails"], ids=out["ids"], ids_mask=out["mask"], alive=out["alive"],
                             log_ratio=out["ratio"])
