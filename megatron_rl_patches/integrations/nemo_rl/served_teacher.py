"""A teacher served by an inference engine as NeMo-RL's distillation teacher (`ServedTeacherPolicy`).

NeMo-RL 7ea279ab's `distillation.setup()` builds the teacher as a second `Policy` on the training
cluster; `distillation_train` then makes three calls on it: `offload_after_refit()` (after setup
and after each step's teacher pass), `prepare_for_lp_inference()` and `get_topk_logits(data,
k=topk_logits_k, timer=timer)`, whose `topk_logits` / `topk_indices` [B, S, k] become the batch's
`teacher_topk_logits` / `teacher_topk_indices`. `ServedTeacherPolicy` answers the three from the
driver through the package's `ServedTeacher`: nothing of the teacher is loaded on the job's GPUs
(offload and prepare have nothing to move), and `topk_logits` are the teacher's top-k log-probs
over its whole vocabulary, so `nemo_rl_topk_kd` forms the exact tail from them (NeMo-RL's own
loss renormalizes them over the k ids, which gives what it gives from logits). Position s of a
row holds the top-k that predicts token s + 1, as NeMo-RL's own teacher writes it; positions no
loss reads (the prompt before the first `token_mask` token, the last token, padding) hold ids
0 .. k−1 at log(1 / (k + 1)): finite log-probs, never read through the masks.

`served_teacher_in_setup(policy)` puts the policy where `setup()` builds the teacher: within the
block, `distillation.Policy(name_prefix="teacher", ...)` returns it and builds nothing (every
other `Policy`, the student's, is NeMo-RL's own); a teacher config whose `generation.temperature`
is not the served teacher's is refused by name (NeMo-RL's own teacher scores at it).

With a head and `full_vocabulary=True` (`served_teacher_policy(url, head=DIR, full_vocabulary=True)`)
`get_topk_logits` also adds the teacher's final hidden states to NeMo-RL's batch as
`teacher_hidden_states` [B, S, H] (the dtype the server sent, position s the state predicting
token s + 1, zeros elsewhere): NeMo-RL ships them to the student workers with the batch, and
within `served_teacher_in_setup` the loss `setup()` builds is `WholeVocabularyDistillationLossFn`,
the whole-vocabulary divergence through the teacher's head there (`vocab_kd`).

With `context=KEY` (`served_teacher_policy(url, context=KEY, tokenizer=...)`) the teacher is
privileged: for each sample it scores NeMo-RL's batch field KEY (one entry per sample: ids, or
text tokenized by the teacher's `tokenizer`) followed by the sample's response ids
(`teachers.with_context`), its rows (and hidden states) placed at the student's response
positions. A missing field, a missing sample, text without a tokenizer, ids past the teacher's
vocabulary, or a sample past the server's max model length is refused naming the sample and the
key, before anything is sent (the driver is one process: nothing to agree).
"""
# lazy imports: optional dependency nemo_rl
from __future__ import annotations

import contextlib
import numbers
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from megatron_rl_patches.integrations.nemo_rl.teacher_policy import Role, TeacherPolicy, teacher_in_setup
from megatron_rl_patches.integrations.nemo_rl.teacher_rows import filler, states_of, student_batch
from megatron_rl_patches.integrations.nemo_rl.vocab_kd import STATES, WholeVocabularyDistillationLossFn
from megatron_rl_patches.ops.scoring_plan import scoring_plan
from megatron_rl_patches.teachers.entry import SERVED, TeacherEntry
from megatron_rl_patches.teachers.head.teacher_head import TeacherHead
from megatron_rl_patches.teachers.kinds import student
from megatron_rl_patches.teachers.served.build import served_teacher_of
from megatron_rl_patches.teachers.served.client import ServedTeacher
from megatron_rl_patches.teachers.served.settings import ClientSettings

# NeMo-RL's distillation.topk_logits_k default
NEMO_RL_TOPK = 64

SERVED_ROLE = Role(name="ServedTeacherPolicy", make="served_teacher_policy(url, ...)",
                   block="served_teacher_in_setup(policy)", who="served",
                   hint="pass ServedTeacherPolicy(teacher=...)")


class ServedTeacherPolicy(TeacherPolicy):
    """NeMo-RL's teacher-policy calls (`get_topk_logits`, `prepare_for_lp_inference`,
    `offload_after_refit`) answered by `teacher`, a `ServedTeacher` whose `top_k` is NeMo-RL's
    `distillation.topk_logits_k`. Runs in NeMo-RL's driver process (no process group). A teacher
    with a `context` key scores each sample's batch field of that name before its response;
    `tokenizer` (the teacher's) reads text contexts."""

    role = SERVED_ROLE

    def __init__(self, teacher: ServedTeacher, full_vocabulary: bool = False, tokenizer: Any = None) -> None:
        if not isinstance(teacher, ServedTeacher):
            raise TypeError(f"ServedTeacherPolicy(teacher=...) takes a megatron_rl_patches.teachers.ServedTeacher, "
                            f"got {type(teacher).__name__}")
        if not isinstance(full_vocabulary, bool):
            raise TypeError(f"ServedTeacherPolicy(full_vocabulary=...) must be True or False, got {full_vocabulary!r}")
        if full_vocabulary and teacher.head is None:
            raise ValueError("ServedTeacherPolicy(full_vocabulary=True) needs a teacher with a head (served_teacher_"
                             "policy(url, head=DIR, full_vocabulary=True) against a vLLM pooling server): an engine's "
                             "prompt log-probs hold only its top-k")
        if full_vocabulary and not (isinstance(teacher.head.source, str) and teacher.head.source):  # type: ignore[union-attr]
            raise ValueError("ServedTeacherPolicy(full_vocabulary=True) needs a head read from a directory: NeMo-RL's "
                             "student workers re-read it from its source (the loss WholeVocabularyDistillationLossFn("
                             "head=DIR)), and this TeacherHead has none (built by hand); pass head=DIR or "
                             "TeacherHead.from_hf(DIR)")
        if full_vocabulary and teacher.invariant is True:
            raise ValueError("ServedTeacherPolicy(full_vocabulary=True): the teacher's plan asks the invariant mode, "
                             "and the whole-vocabulary divergence (lm_head_divergence) has none yet: build the teacher "
                             "with ScoringPlan(VOCAB, invariant=None or False), or distil over the top-k "
                             "(full_vocabulary=False), whose ops run in it")
        if tokenizer is not None and teacher.context is None:
            raise ValueError("ServedTeacherPolicy(tokenizer=...) reads text contexts, and the teacher has no context "
                             "key: pass served_teacher_policy(url, context=KEY, tokenizer=...) or drop tokenizer")
        super().__init__(teacher, teacher.context, tokenizer)
        self.teacher: ServedTeacher = teacher
        self.full_vocabulary = full_vocabulary

    def __repr__(self) -> str:
        return f"ServedTeacherPolicy({self.teacher!r})"

    # ------------------------------------------------------------------ scoring
    def get_topk_logits(self, data: Any, k: int, micro_batch_size: int | None = None,
                        timer: Any = None) -> Any:
        """`topk_logits` (float32 log-probs over the teacher's whole vocabulary) and `topk_indices`
        (int64), [B, S, k], as NeMo-RL's `BatchedDataDict`; `data`'s tensors are untouched (with
        `full_vocabulary`, `data` gains `teacher_hidden_states`, also in the result)."""
        self.check_k(k)
        batch, (rows_b, seq) = student_batch(data)
        starts = batch.response_starts
        key = self.context
        scored = self.privileged(batch, data, key) if key is not None else batch
        with timer.time("get_topk_logits/served_teacher") if timer is not None else contextlib.nullcontext():
            scores = self.teacher.score(scored)
        values, indices = filler(rows_b, seq, self.teacher.plan.k)
        for i, start in enumerate(starts):
            rows = batch.response_rows(i)
            values[i, start - 1:start - 1 + rows] = scores.topk_log_probs[i].to(torch.float32)
            indices[i, start - 1:start - 1 + rows] = scores.topk_ids[i].to(torch.int64)
        result = {"topk_logits": values, "topk_indices": indices}
        if self.full_vocabulary:
            data[STATES] = result[STATES] = states_of(scores.hidden_states, starts, seq)
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict  # lazy: optional dependency nemo_rl

        return BatchedDataDict(result)

    def context_vocab(self) -> int | None:
        """The teacher head's vocabulary, else the named tokenizer's (None: neither)."""
        head = self.teacher.head
        return head.vocab_size if head is not None else super().context_vocab()

    def check_k(self, k: object) -> None:
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or int(k) != self.teacher.top_k:
            raise ValueError(f"ServedTeacherPolicy.get_topk_logits(k={k!r}): the served teacher was built with "
                             f"top_k={self.teacher.top_k}; set NeMo-RL's distillation.topk_logits_k to "
                             f"{self.teacher.top_k} or build the teacher with top_k={k!r}")

    # ------------------------------------------------------------------ setup: nothing built for the teacher
    def teacher_built(self, build: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """This policy for `Policy(name_prefix="teacher", ...)` (its config's temperature checked),
        NeMo-RL's `Policy` for every other."""
        if kwargs.get("name_prefix") != "teacher":
            return build(*args, **kwargs)
        check_temperature(self, kwargs.get("config"))
        return self

    def setup_names(self, module: Any) -> dict[str, Any]:
        """With `full_vocabulary`, `DistillationLossFn(cfg)` answered by the whole-vocabulary loss."""
        if not self.full_vocabulary:
            return {}

        def build_loss(cfg: Any) -> Any:
            return WholeVocabularyDistillationLossFn(cfg, head=self.teacher.head.source,  # type: ignore[union-attr]
                                                     temperature=self.teacher.temperature)

        return {"DistillationLossFn": build_loss}


def served_teacher_in_setup(policy: ServedTeacherPolicy, module: Any = None) -> AbstractContextManager[Any]:
    """Within the block NeMo-RL's `distillation.setup()` gets `policy` as its teacher: the name
    `Policy` in `module` (default `nemo_rl.algorithms.distillation`) answers
    `Policy(name_prefix="teacher", ...)` with `policy` and passes every other call to NeMo-RL's
    `Policy`; with a `full_vocabulary` policy, `DistillationLossFn(cfg)` answers with
    `WholeVocabularyDistillationLossFn(cfg, head=the teacher head's directory, temperature=...)`;
    restored on exit (`teacher_in_setup`)."""
    return teacher_in_setup(policy, module, SERVED_ROLE)


def check_temperature(policy: ServedTeacherPolicy, config: Any) -> None:
    """NeMo-RL's own teacher scores its top-k at its config's `generation.temperature` (when the
    teacher config has a generation section): the served teacher must score at the same one."""
    generation = config.get("generation") if isinstance(config, dict) else None
    wanted = 1.0 if not generation or generation.get("temperature") is None else float(generation["temperature"])
    if wanted != policy.teacher.temperature:
        raise ValueError(f"served_teacher_in_setup: the teacher's config asks generation.temperature={wanted} "
                         f"(NeMo-RL's own teacher scores its top-k there) but the served teacher scores at "
                         f"{policy.teacher.temperature}: serve hidden states and pass served_teacher_policy(..., "
                         f"head=..., temperature={wanted}) (engines' prompt log-probs are at temperature 1 only), "
                         f"or set the teacher's generation.temperature to {policy.teacher.temperature}")


def served_teacher_policy(url: str, *, engine: str = "vllm", top_k: int = NEMO_RL_TOPK,
                          head: TeacherHead | str | os.PathLike[str] | None = None, temperature: float = 1.0,
                          model: str | None = None, client: ClientSettings | None = None,
                          full_vocabulary: bool = False, context: str | None = None,
                          tokenizer: Any = None) -> ServedTeacherPolicy:
    """NeMo-RL's distillation teacher served at `url`: `ServedTeacher(url, engine, top_k, head=...,
    temperature=..., model=..., client=...)` behind NeMo-RL's teacher-policy calls. `top_k` is
    NeMo-RL's `distillation.topk_logits_k` (default 64: serve vLLM with `--max-logprobs 64` or
    more, or a pooling server with `head=`, which serves any K and any temperature).
    `full_vocabulary=True` (with `head=`): the teacher's hidden states reach the student's loss,
    the whole-vocabulary divergence (`WholeVocabularyDistillationLossFn`). `context=KEY`: a
    privileged teacher reading each sample's context from NeMo-RL's batch field KEY (ids, or text
    through `tokenizer`, the teacher's: a tokenizers.Tokenizer, tokenizer.json or directory). The
    live self-teacher's word (`student`, `student;context=KEY`) is refused by name, pointing to
    `self_teacher_policy` (the student's own policy)."""
    if isinstance(url, str) and student.recognizes(url):
        raise ValueError(f"served_teacher_policy({url!r}): the live self-teacher ('student;context=KEY') is the "
                         "student's own policy, not a served one: use self_teacher_policy(context=KEY) inside "
                         "self_teacher_in_setup(policy) around NeMo-RL's distillation setup()")
    entry = TeacherEntry(url, kind=SERVED, engine=engine, context=context)  # the URL checked by the client
    plan = scoring_plan(None, top_k, temperature, "ServedTeacher")  # NeMo-RL's topk_logits_k, its temperature
    return ServedTeacherPolicy(served_teacher_of(entry, plan, model=model, client=client, head=head),
                               full_vocabulary=full_vocabulary, tokenizer=tokenizer)
