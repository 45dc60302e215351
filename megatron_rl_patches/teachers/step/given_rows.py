"""Answers a teacher step is given instead of asking (`TeacherStep.add(batch, scored={i: ...})`: a
rollout's served teacher, slime's carried rows) checked as a served reply is checked
(`served.rows_check`, the one check) before the step reads them: per sample its response rows, K,
dtypes, log-probabilities (no NaN, none above 0, a top-k mass of at most 1), ids >= 0 (and within
the vocabulary the giver names), and the kind the teacher returns (a `BatchScores` of top-k rows,
or with a head its hidden states [R, H] in its dtype, finite).

An answer that fails is refused, never asked again in its place: its digest said it was this
sample's answer, so it is corrupted data (or data of another teacher), and a step that quietly
asked again would hide the fault that made it. The refusal names the teacher, the sample (its place
in the added part) and where the rows came from (`ScoredBefore.origin`)."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.contract import BatchScores
from megatron_rl_patches.teachers.served.rows_check import scores_problem, states_problem

GIVEN = "scored= of TeacherStep.add()"  # where a given answer came from, unless its ScoredBefore names a place


def given_problem(teacher: Any, index: int, runs: list[tuple[int, int, Any]], batch: TeacherBatch,
                  origin: str = GIVEN, vocab_size: int | None = None) -> Exception | None:
    """What is wrong with the answers teacher `index` is given for a part (`runs`: `(lo, hi,
    answer)` of `batch`, its batch of the part; an answer None is asked), None: nothing."""
    head = getattr(teacher, "head", None)
    for lo, hi, answer in runs:
        if answer is None:
            continue
        said = f"TeacherStep.add: teacher {index}'s rows given for samples {lo}..{hi - 1} ({origin})"
        if head is None and not isinstance(answer, BatchScores):
            return TypeError(f"{said} are a {type(answer).__name__}: a served teacher without a head answers a "
                             "BatchScores of top-k rows (hidden states only for a teacher with a head)")
        if head is not None and not isinstance(answer, (list, tuple)):
            return TypeError(f"{said} are a {type(answer).__name__}: a served teacher with a head answers its hidden "
                             "states, one [R, H] tensor per sample")
        if head is None and not all(isinstance(field, (list, tuple)) and len(field) == hi - lo for field in (
                answer.token_log_probs, answer.topk_ids, answer.topk_log_probs, answer.tail_log_probs)):
            return ValueError(f"{said}: a BatchScores whose four fields are not each a list of {hi - lo} tensors "
                              "(one per sample)")
        if head is not None and len(answer) != hi - lo:
            return ValueError(f"{said}: {len(answer)} hidden-state tensors for {hi - lo} samples")
        for offset in range(hi - lo):
            sample = lo + offset
            rows = batch.response_rows(sample)
            if head is None:
                extra = [name for name in ("hidden_states", "ids_log_probs", "ids_tail_log_probs")
                         if getattr(answer, name) is not None]
                wrong = f"{extra[0]} is not None (a teacher without a head sends none)" if extra else \
                    scores_problem(answer.token_log_probs[offset], answer.topk_ids[offset],
                                   answer.topk_log_probs[offset], answer.tail_log_probs[offset], rows,
                                   teacher.top_k, vocab_size)
            else:
                wrong = states_problem(answer[offset], rows, head.hidden_size, getattr(teacher, "hidden_dtype", None))
            if wrong is not None:
                return ValueError(f"TeacherStep.add: teacher {index}'s rows of sample {sample} ({origin}) are not "
                                  f"what the served teacher answers: {wrong} (its {rows} response rows at "
                                  f"K = {teacher.top_k} expected): give the rows it sent, or none (the step then "
                                  "asks it)")
    return None
