"""What a teacher with another tokenizer needs around its forward passes, in any framework: each
sample re-tokenized for the teacher on the whole sequence (the prompt/response boundary and every
loss-mask change are forced chunk boundaries), the teacher's own micro-batches split under the
student's token budget (`PassBatches`: plain indices; a framework builds its own batch from them), the
chunk-start buckets over shared byte strings, and the teacher's values brought back to the student's
response rows (whole responses: a chunk can straddle context-parallel ranks, each rank cuts its rows
afterwards). slime's top-k OPD runs its passes (`integrations/megatron/opd/cross_passes.py`, its rollout
built by `integrations/megatron/opd/cross_rollout.py`); the module was `integrations/slime/cross_teachers.py`."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl_patches.cross_tokenizer.alignment import Alignment
from megatron_rl_patches.cross_tokenizer.losses import alive_strings, bucket_log_probs
from megatron_rl_patches.cross_tokenizer.retokenizing import retokenize
from megatron_rl_patches.cross_tokenizer.spreading import spread_chunk_log_probs
from megatron_rl_patches.cross_tokenizer.vocabulary import SharedVocabulary


@dataclass(frozen=True)
class TeacherSample:
    """One sample for the teacher: its ids of the whole sequence, how many are the response, and
    the alignment of the two responses (`student_chunk` [R_student], `teacher_chunk` [R_teacher])."""

    tokens: torch.Tensor
    response_length: int
    alignment: Alignment


def loss_mask_boundaries(prompt_length: int, loss_mask: Sequence[int] | torch.Tensor) -> list[int]:
    """The forced chunk starts of a sample (token indices of the whole sequence): the response's
    first token and every response token where the loss mask changes (a tool output's edges)."""
    mask = [int(m) for m in (loss_mask.tolist() if isinstance(loss_mask, torch.Tensor) else loss_mask)]
    return [prompt_length] + [prompt_length + i for i in range(1, len(mask)) if mask[i] != mask[i - 1]]


def teacher_sample(tokens: torch.Tensor, response_length: int, loss_mask: Sequence[int] | torch.Tensor,
                   student_tokenizer: Any, teacher_tokenizer: Any, stop_tokens: Any = None) -> TeacherSample:
    """The teacher's sample for the student's `tokens` (prompt then `response_length` response ids):
    the whole sequence re-tokenized (special tokens mapped by content, or by `stop_tokens`), the
    alignment cut to the responses and renumbered from 0."""
    ids = [int(t) for t in tokens.tolist()]
    prompt = len(ids) - int(response_length)
    if prompt < 0 or len(loss_mask) != response_length:
        raise ValueError(f"tokens holds {len(ids)} ids, response_length is {response_length} and loss_mask "
                         f"holds {len(loss_mask)} values: pass the whole sequence (prompt then response), the "
                         "response's length (at most the sequence's) and one loss-mask value per response token")
    t_ids, alignment = retokenize(ids, student_tokenizer, teacher_tokenizer,
                                  boundaries=loss_mask_boundaries(prompt, loss_mask), stop_tokens=stop_tokens)
    prompt_chunks = alignment.student_chunk[:prompt]
    first = int(prompt_chunks.max()) + 1 if bool((prompt_chunks >= 0).any()) else 0
    t_prompt = int((alignment.teacher_chunk < first).sum())
    student = alignment.student_chunk[prompt:]
    student = torch.where(student >= 0, student - first, student)
    teacher = alignment.teacher_chunk[t_prompt:] - first
    if teacher.numel() == 0:
        raise ValueError(f"a response of {response_length} student tokens has no teacher token (every token "
                         "excluded: invalid UTF-8 or special tokens the teacher lacks); map its stop tokens")
    response = Alignment(student, teacher, alignment.n_chunks - first, alignment.invalid_utf8, alignment.unspelled,
                         alignment.unmapped_special)
    return TeacherSample(t_ids.to(tokens.device), int(teacher.numel()), response)


def student_budget(lengths: Sequence[int], micro_batches: Sequence[Sequence[int]]) -> int:
    """The token budget of the student's micro-batches (each a list of sample indices into
    `lengths`, the samples' token counts): the most tokens one of them packs."""
    return max((sum(int(lengths[i]) for i in batch) for batch in micro_batches), default=1)


def split_micro_batches(lengths: Sequence[int], budget: int, at_least: int = 1) -> list[list[int]]:
    """Samples in order, packed into micro-batches of at most `budget` tokens (a longer sample on
    its own): the teacher's sequences can be longer than the student's, so they may need more; at
    least `at_least` of them (the student's count: pipeline schedules may ask a minimum), the
    largest split in two while it holds several samples."""
    if budget < 1:
        raise ValueError(f"budget must be a positive token count, got {budget}")
    batches = _packed(lengths, budget)
    while len(batches) < at_least:
        splittable = [i for i, batch in enumerate(batches) if len(batch) > 1]
        if not splittable:
            break
        i = max(splittable, key=lambda j: sum(int(lengths[s]) for s in batches[j]))
        half = len(batches[i]) // 2
        batches[i: i + 1] = [batches[i][:half], batches[i][half:]]
    return batches


def _packed(lengths: Sequence[int], budget: int) -> list[list[int]]:
    batches: list[list[int]] = []
    used = budget + 1
    for index, length in enumerate(lengths):
        if used + int(length) > budget:
            batches.append([])
            used = 0
        batches[-1].append(index)
        used += int(length)
    return batches


@dataclass(frozen=True)
class PassBatches:
    """The teacher's micro-batches: each a list of indices into its samples followed by the
    repeats (`repeats[i]`: the sample the extra sample `len(samples) + i` repeats)."""

    micro_batches: list[list[int]]
    repeats: list[int]

    def padded(self, per_sample: Sequence[Any]) -> list[Any]:
        """Per-sample values of the samples for every sample the passes run (repeats included)."""
        return [*per_sample, *(per_sample[j] for j in self.repeats)]

    def unpadded(self, per_sample: Sequence[Any]) -> list[Any]:
        """A pass's per-sample values without its repeats (the samples' own)."""
        return list(per_sample[:len(per_sample) - len(self.repeats)])


def pass_batches(lengths: Sequence[int], budget: int, at_least: int = 1) -> PassBatches:
    """The teacher's micro-batches over samples of `lengths` tokens (`split_micro_batches`, at least
    `at_least`). Where the samples cannot be split into that many, the shortest one is repeated as a
    micro-batch of its own (its values dropped: `unpadded`): every rank of a group whose forwards
    pair up collectives (an expert-parallel group's dispatcher) runs as many."""
    batches = split_micro_batches(lengths, budget, at_least)
    missing = max(0, at_least - len(batches)) if len(lengths) else 0
    repeats = [min(range(len(lengths)), key=lambda i: int(lengths[i]))] * missing if missing else []
    return PassBatches(batches + [[len(lengths) + i] for i in range(missing)], repeats)


def log_ratio(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, alignment: Alignment
              ) -> torch.Tensor:
    """Per student response token, `spread − log pS` = (ℓT_j − ℓS_j)/|S_j| for its chunk j (0 for
    excluded tokens): the token-level signal the loss and slime's `--use-opd` read."""
    s = student_log_probs.detach().to(torch.float64)
    spread = spread_chunk_log_probs(s, teacher_log_probs.detach().to(torch.float64).to(s.device), alignment)
    return (spread - s).to(student_log_probs.dtype)


@dataclass(frozen=True)
class Buckets:
    """A sample's chunk-start buckets: the teacher's ids per bucket on its rows ([R_teacher, k·D_t]
    and mask), the student's on its rows ([R_student, k·D_s] and mask), and which buckets are
    alive on the student's rows ([R_student, k]; none outside chunk starts)."""

    teacher_ids: torch.Tensor
    teacher_mask: torch.Tensor
    student_ids: torch.Tensor
    student_mask: torch.Tensor
    alive: torch.Tensor


def chunk_start_buckets(teacher_top: torch.Tensor, alignment: Alignment, shared: SharedVocabulary) -> Buckets:
    """The buckets at each chunk's first tokens from the teacher's top-k ids on its response rows
    [R_teacher, k]: the shared strings among them (each once), every id of each string per side
    (widths fixed per tokenizer pair, so samples stack). An id past the teacher's tokenizer (a
    model's vocabulary padded beyond it: Megatron's padding, a config's spare rows) spells nothing:
    no string."""
    device = teacher_top.device
    s_rows, t_rows = (rows.to(device) for rows in alignment.chunk_starts())
    table, top = shared.teacher_string.to(device), teacher_top[t_rows]
    spelled = top < table.numel()
    strings, alive = alive_strings(torch.where(spelled, table[top.clamp(max=table.numel() - 1)], -1))
    t_ids, t_mask = shared.bucket_ids(strings, alive, "teacher", shared.most_ids("teacher"))
    s_ids, s_mask = shared.bucket_ids(strings, alive, "student", shared.most_ids("student"))

    def placed(values: torch.Tensor, rows: torch.Tensor, length: int) -> torch.Tensor:
        out = values.new_zeros((length, values.shape[-1]))
        out[rows] = values
        return out

    n_s, n_t = alignment.student_chunk.numel(), alignment.teacher_chunk.numel()
    return Buckets(placed(t_ids, t_rows, n_t), placed(t_mask, t_rows, n_t), placed(s_ids, s_rows, n_s),
                   placed(s_mask, s_rows, n_s), placed(alive, s_rows, n_s))


def teacher_buckets_on_student_rows(id_log_probs: torch.Tensor, tail: torch.Tensor, buckets: Buckets,
                                    alignment: Alignment) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's log P(bucket) [R_student, k] and log tail [R_student] on the student's rows,
    from its per-id log-probs [R_teacher, k·D_t] and tails [R_teacher] at its own rows (each chunk
    start's values moved to the student's first token of that chunk; 0 elsewhere, no bucket alive)."""
    s_rows, t_rows = (rows.to(id_log_probs.device) for rows in alignment.chunk_starts())
    alive = buckets.alive.to(id_log_probs.device)
    grouped = bucket_log_probs(id_log_probs[t_rows], buckets.teacher_mask.to(id_log_probs.device)[t_rows],
                               alive[s_rows])
    values = torch.full(alive.shape, -torch.inf, dtype=id_log_probs.dtype, device=id_log_probs.device)
    values[s_rows] = grouped
    tails = torch.zeros(alive.shape[0], dtype=tail.dtype, device=tail.device)
    tails[s_rows.to(tail.device)] = tail[t_rows.to(tail.device)]
    return values, tails
