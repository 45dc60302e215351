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
import importlib
import math
import numbers
import os
from collections.abc import Iterator
from typing import Any

import torch

from megatron_rl_patches.integrations.context_fields import tokenizer_vocab
from megatron_rl_patches.integrations.nemo_rl.privileged import privileged_batch
from megatron_rl_patches.integrations.nemo_rl.rollout_contexts import ROLLOUTS, remembering
from megatron_rl_patches.integrations.nemo_rl.vocab_kd import STATES, WholeVocabularyDistillationLossFn
from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.head import TeacherHead
from megatron_rl_patches.teachers.kinds import student
from megatron_rl_patches.teachers.kinds.entry import SERVED, TeacherEntry
from megatron_rl_patches.teachers.served.build import served_teacher_of
from megatron_rl_patches.teachers.served.client import ServedTeacher
from megatron_rl_patches.teachers.served.settings import ClientSettings

# NeMo-RL's distillation.topk_logits_k default
NEMO_RL_TOPK = 64


class ServedTeacherPolicy:
    """NeMo-RL's teacher-policy calls (`get_topk_logits`, `prepare_for_lp_inference`,
    `offload_after_refit`) answered by `teacher`, a `ServedTeacher` whose `top_k` is NeMo-RL's
    `distillation.topk_logits_k`. Runs in NeMo-RL's driver process (no process group). A teacher
    with a `context` key scores each sample's batch field of that name before its response;
    `tokenizer` (the teacher's) reads text contexts."""

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
        if tokenizer is not None and teacher.context is None:
            raise ValueError("ServedTeacherPolicy(tokenizer=...) reads text contexts, and the teacher has no context "
                             "key: pass served_teacher_policy(url, context=KEY, tokenizer=...) or drop tokenizer")
        self.teacher = teacher
        self.full_vocabulary = full_vocabulary
        self.tokenizer = tokenizer
        self.rollout_values: list[Any] | None = None  # the last rollout batch's contexts (rollout_contexts)

    def __repr__(self) -> str:
        return f"ServedTeacherPolicy({self.teacher!r})"

    # ------------------------------------------------------------------ residency: nothing to move
    def prepare_for_lp_inference(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load: the teacher's weights live on the server."""

    def offload_after_refit(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to offload: no teacher weights on the job's GPUs."""

    def offload_before_refit(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to offload: no teacher weights on the job's GPUs."""

    # ------------------------------------------------------------------ scoring
    def get_topk_logits(self, data: Any, k: int, micro_batch_size: int | None = None,
                        timer: Any = None) -> Any:
        """`topk_logits` (float32 log-probs over the teacher's whole vocabulary) and `topk_indices`
        (int64), [B, S, k], as NeMo-RL's `BatchedDataDict`; `data`'s tensors are untouched (with
        `full_vocabulary`, `data` gains `teacher_hidden_states`, also in the result)."""
        self.check_k(k)
        ids, lengths, starts = rows_of(data)
        batch = TeacherBatch(sequences=[ids[i, :int(lengths[i])] for i in range(ids.shape[0])],
                             response_starts=starts)
        key = self.teacher.context
        scored = self.privileged(batch, data, key) if key is not None else batch
        with timer.time("get_topk_logits/served_teacher") if timer is not None else contextlib.nullcontext():
            scores = self.teacher.score(scored)
        values, indices = filler(ids.shape[0], ids.shape[1], self.teacher.top_k)
        for i, start in enumerate(starts):
            rows = batch.response_rows(i)
            values[i, start - 1:start - 1 + rows] = scores.topk_log_probs[i].to(torch.float32)
            indices[i, start - 1:start - 1 + rows] = scores.topk_ids[i].to(torch.int64)
        result = {"topk_logits": values, "topk_indices": indices}
        if self.full_vocabulary:
            data[STATES] = result[STATES] = states_of(scores.hidden_states, starts, ids.shape[1])
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict  # lazy: optional dependency nemo_rl

        return BatchedDataDict(result)

    def privileged(self, batch: TeacherBatch, data: Any, key: str) -> TeacherBatch:
        """The teacher's batch: each sample's context (the batch field `key`) then its response ids."""
        values, self.rollout_values = self.rollout_values, None
        head = self.teacher.head
        vocab = head.vocab_size if head is not None else tokenizer_vocab(self.tokenizer)
        return privileged_batch(batch, data, key, values, self.tokenizer, vocab,
                                "ServedTeacherPolicy.get_topk_logits(data)", "served_teacher_in_setup(policy)")

    def check_k(self, k: object) -> None:
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or int(k) != self.teacher.top_k:
            raise ValueError(f"ServedTeacherPolicy.get_topk_logits(k={k!r}): the served teacher was built with "
                             f"top_k={self.teacher.top_k}; set NeMo-RL's distillation.topk_logits_k to "
                             f"{self.teacher.top_k} or build the teacher with top_k={k!r}")


def states_of(states: Any, starts: list[int], seq: int) -> torch.Tensor:
    """[B, S, H] of each sample's hidden states [R_i, H] at positions start − 1 .. (the state
    predicting token s + 1 at s), zeros at positions no loss reads (every one where no sample has
    a row: a sample of no rows comes as [0, H] in the dtype the states travel in)."""
    width = states[0].shape[-1] if len(states) else 0
    dtype = states[0].dtype if len(states) else torch.float32
    out = torch.zeros(len(states), seq, width, dtype=dtype)
    for i, (rows, start) in enumerate(zip(states, starts)):
        out[i, start - 1:start - 1 + rows.shape[0]] = rows.to(dtype)
    return out


def filler(batch: int, seq: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S, k] rows no loss reads: ids 0 .. k−1 at log(1 / (k + 1)) (a finite tail is left)."""
    values = torch.full((batch, seq, k), -math.log(k + 1), dtype=torch.float32)
    indices = torch.arange(k, dtype=torch.int64).expand(batch, seq, k).clone()
    return values, indices


def rows_of(data: Any) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """`input_ids` [B, S], `input_lengths` [B] and each sample's first scored position: the first
    token `token_mask` marks (at least 1; the sample's length when it marks none), 1 without one."""
    for key in ("input_ids", "input_lengths"):
        if key not in data:
            raise ValueError(f"ServedTeacherPolicy.get_topk_logits(data): data has no {key!r} (NeMo-RL's "
                             f"distillation batch holds input_ids, input_lengths, token_mask)")
    ids, lengths = data["input_ids"], data["input_lengths"]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"ServedTeacherPolicy.get_topk_logits(data): data['input_ids'] must be a [B, S] integer "
                        f"tensor, got {getattr(ids, 'shape', type(ids).__name__)}")
    if not isinstance(lengths, torch.Tensor) or tuple(lengths.shape) != (ids.shape[0],) \
            or lengths.dtype.is_floating_point:
        raise TypeError(f"ServedTeacherPolicy.get_topk_logits(data): data['input_lengths'] must be a [B] = "
                        f"[{ids.shape[0]}] integer tensor, got {getattr(lengths, 'shape', type(lengths).__name__)}")
    if lengths.numel() and (int(lengths.min()) < 1 or int(lengths.max()) > ids.shape[1]):
        raise ValueError(f"ServedTeacherPolicy.get_topk_logits(data): data['input_lengths'] must lie in "
                         f"[1, {ids.shape[1]}] (the padded length), got {lengths.tolist()}")
    ids, lengths = ids.detach().cpu(), lengths.detach().cpu()
    mask = data["token_mask"] if "token_mask" in data else None
    if mask is not None and (not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(ids.shape)
                             or mask.dtype.is_floating_point and not bool(((mask == 0) | (mask == 1)).all())):
        shown = f"{tuple(mask.shape)} {mask.dtype}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"ServedTeacherPolicy.get_topk_logits(data): data['token_mask'] must be a [B, S] = "
                        f"{list(ids.shape)} tensor of 0 / 1 (input_ids' shape: 1 on the tokens the loss reads), got "
                        f"{shown}")
    starts = []
    for i in range(ids.shape[0]):
        length = int(lengths[i])
        if mask is None:
            starts.append(1)
            continue
        marked = torch.nonzero(mask[i, 1:length].detach().cpu()).flatten()
        starts.append(int(marked[0]) + 1 if marked.numel() else length)
    return ids, lengths, starts


@contextlib.contextmanager
def served_teacher_in_setup(policy: ServedTeacherPolicy, module: Any = None) -> Iterator[ServedTeacherPolicy]:
    """Within the block NeMo-RL's `distillation.setup()` gets `policy` as its teacher: the name
    `Policy` in `module` (default `nemo_rl.algorithms.distillation`) answers
    `Policy(name_prefix="teacher", ...)` with `policy` and passes every other call to NeMo-RL's
    `Policy`; with a `full_vocabulary` policy, `DistillationLossFn(cfg)` answers with
    `WholeVocabularyDistillationLossFn(cfg, head=the teacher head's directory, temperature=...)`;
    restored on exit."""
    if not isinstance(policy, ServedTeacherPolicy):
        raise TypeError(f"served_teacher_in_setup(policy=...) takes a ServedTeacherPolicy (served_teacher_policy("
                        f"url, ...)), got {type(policy).__name__}")
    if module is None:
        module = importlib.import_module("nemo_rl.algorithms.distillation")  # lazy: optional dependency nemo_rl
    original, original_loss = module.Policy, getattr(module, "DistillationLossFn", None)

    def build_loss(cfg: Any) -> Any:
        return WholeVocabularyDistillationLossFn(cfg, head=policy.teacher.head.source,  # type: ignore[union-attr]
                                                 temperature=policy.teacher.temperature)

    def build(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("name_prefix") != "teacher":
            return original(*args, **kwargs)
        check_temperature(policy, kwargs.get("config"))
        return policy

    def keep(values: list[Any]) -> None:
        policy.rollout_values = values

    key = policy.teacher.context
    rollouts = {name: getattr(module, name) for name in ROLLOUTS if key is not None and hasattr(module, name)}
    module.Policy = build
    if policy.full_vocabulary:
        module.DistillationLossFn = build_loss
    for name, rollout in rollouts.items():
        setattr(module, name, remembering(rollout, key, keep))  # type: ignore[arg-type]
    try:
        yield policy
    finally:
        module.Policy = original
        if policy.full_vocabulary:
            module.DistillationLossFn = original_loss
        for name, rollout in rollouts.items():
            setattr(module, name, rollout)


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
    return ServedTeacherPolicy(served_teacher_of(entry, top_k=top_k, model=model, temperature=temperature,
                                                 client=client, head=head),
                               full_vocabulary=full_vocabulary, tokenizer=tokenizer)
