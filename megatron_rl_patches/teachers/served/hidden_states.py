"""A step's `BatchScores` from a served teacher's final hidden states through its head on the
trainer (`head_scores`): every sample's response rows in one pass of each fused op (tile by tile;
no [rows, V] tensor), at any K and temperature, and at ids the caller gives (`check_given_ids`)."""
from __future__ import annotations

import os

import torch

from megatron_rl_patches.ops._checks import largest_temperature, smallest_temperature, temperature_range
from megatron_rl_patches.ops.scoring_plan import VOCAB, ScoringPlan
from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.contract import BatchScores
from megatron_rl_patches.teachers.finite import finite, shown
from megatron_rl_patches.teachers.head.teacher_head import TeacherHead
from megatron_rl_patches.teachers.served.engines.vllm_pooling import EMBED_DTYPES

# the dtypes a model's hidden states travel in exactly (the default: the checkpoint's own among them)
LOSSLESS = (torch.float32, torch.bfloat16, torch.float16)
# engines whose hidden states are not served yet, and why
HIDDEN_NOT_SERVED = {"sglang": "SGLang's hidden states (/generate with return_hidden_states) stay refused until a test "
                               "runs against a real SGLang server (its server does not run on this project's CPUs)"}


def hidden_head(head: object, engine: object) -> TeacherHead | None:
    """`ServedTeacher(head=...)`: None, a TeacherHead, or a Hugging Face checkpoint directory (its
    head read whole, on this rank); the engine must serve hidden states."""
    if head is None:
        return None
    if isinstance(engine, str) and engine in HIDDEN_NOT_SERVED:
        raise ValueError(f"ServedTeacher(engine={engine!r}, head=...): {HIDDEN_NOT_SERVED[engine]}; serve the teacher "
                         f"with vLLM's pooling runner (engine='vllm')")
    if isinstance(head, TeacherHead):
        return head
    if isinstance(head, (str, os.PathLike)):
        return TeacherHead.from_hf(head)
    raise TypeError(f"ServedTeacher(head=...) must be a TeacherHead (TeacherHead.from_hf(DIR, tp_group=...)) or the "
                    f"teacher's Hugging Face checkpoint directory, got {type(head).__name__}")


def head_temperature(temperature: object, top_k: object, head: TeacherHead) -> float:
    """A temperature the head's ops compute (the trainer applies it: finite, > 0, within
    `temperature_range` of the head's dtype) and K within the head's vocabulary (`VOCAB`: no K)."""
    if not isinstance(temperature, (int, float)) or not finite(temperature) or temperature <= 0:
        raise ValueError(f"ServedTeacher(temperature=...) must be a finite number > 0, got {shown(temperature)}")
    if not smallest_temperature(head.dtype) <= temperature <= largest_temperature(head.dtype):
        raise ValueError(f"ServedTeacher(temperature={temperature!r}) is outside the temperatures the head's ops "
                         f"compute: {temperature_range(head.dtype)}")
    if top_k is not VOCAB and top_k >= head.vocab_size:  # type: ignore[operator]
        raise ValueError(f"ServedTeacher(top_k={top_k}) must be smaller than the teacher head's vocabulary of "
                         f"{head.vocab_size} (the tail bucket holds the rest; at K = vocabulary - 1 it is the last id)")
    return float(temperature)


def states_dtype(dtype: object, head: TeacherHead | None) -> torch.dtype | None:
    """The dtype the hidden states travel in: `dtype` (fp8 only when asked: lossy), else the head's
    checkpoint's (the served model's, lossless), float32 where that is not float32 / bf16 / fp16.
    None without a head (nothing travels: a `dtype` given then is refused, never ignored)."""
    if head is None:
        if dtype is not None:
            raise ValueError(f"ServedTeacher(hidden_dtype={dtype!r}) is the dtype a head's hidden states travel in, "
                             "and this teacher has no head (its engine sends prompt log-probs): give "
                             "head=TeacherHead or the checkpoint directory, or drop hidden_dtype")
        return None
    if dtype is not None:
        if not isinstance(dtype, torch.dtype) or dtype not in EMBED_DTYPES:
            raise (ValueError if isinstance(dtype, torch.dtype) else TypeError)(
                f"ServedTeacher(hidden_dtype=...) must be a torch.dtype, one of {[str(d) for d in EMBED_DTYPES]}, or "
                f"None (the head's checkpoint's dtype), got {dtype!r}"
                + ("" if isinstance(dtype, torch.dtype) else f", a {type(dtype).__name__}"))
        return dtype
    own = head.checkpoint_dtype
    return own if own in LOSSLESS else torch.float32


# the dtypes ids may come in (no float, complex, bool or unsigned type wider than a byte: torch reduces few of them)
ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_given_ids(ids: object, batch: TeacherBatch, vocab_size: int) -> list[torch.Tensor] | None:
    """`ids` of `score(batch, ids=...)`: None, or one [R_i, k] integer tensor per sample (one k),
    each id in [0, vocab_size), no id twice in a row (the op refuses repeats: refused here, before
    anything is sent); TypeError / ValueError naming the sample otherwise."""
    if ids is None:
        return None
    if not isinstance(ids, (list, tuple)) or len(ids) != len(batch):
        raise TypeError(f"ServedTeacher.score(ids=...) must be a list of {len(batch)} id tensors [R_i, k] (one per "
                        f"sample: the ids to score on each response row), got {type(ids).__name__}"
                        + (f" of {len(ids)}" if isinstance(ids, (list, tuple)) else ""))
    widths = set()
    for i, given in enumerate(ids):
        rows = batch.response_rows(i)
        if not isinstance(given, torch.Tensor) or given.dim() != 2 or given.shape[0] != rows \
                or given.dtype not in ID_DTYPES:
            shown = f"{tuple(given.shape)} {given.dtype}" if isinstance(given, torch.Tensor) else type(given).__name__
            raise ValueError(f"ServedTeacher.score(ids=...): sample {i}'s ids must be an integer tensor [{rows}, k] "
                             f"(one row per response row), got {shown}")
        if given.numel() and not 0 <= int(given.min()) <= int(given.max()) < vocab_size:
            raise ValueError(f"ServedTeacher.score(ids=...): sample {i} holds ids outside [0, {vocab_size}) (the "
                             f"teacher head's vocabulary)")
        ordered = given.detach().cpu().long().sort(dim=1).values
        twice = (ordered[:, 1:] == ordered[:, :-1]).nonzero()
        if twice.numel():
            row, column = (int(v) for v in twice[0])
            raise ValueError(f"ServedTeacher.score(ids=...): sample {i}'s row {row} holds id "
                             f"{int(ordered[row, column])} twice; give each row distinct ids (the log-probs at "
                             f"them and the tail outside them count each id once)")
        widths.add(given.shape[1])
    if len(widths) > 1:
        raise ValueError(f"ServedTeacher.score(ids=...): every sample must give the same number of ids per row, got "
                         f"{sorted(widths)}")
    return list(ids)


def head_scores(head: TeacherHead, batch: TeacherBatch, states: list[torch.Tensor], plan: ScoringPlan,
                given: list[torch.Tensor] | None = None) -> BatchScores:
    """`BatchScores` (float64) from `states[i]` [R_i, H] through `head` at the plan's temperature
    and invariant mode: the actual tokens' log-probs, the teacher's own top-k (the plan's K;
    `VOCAB`: none) with their exact tail (`TeacherHead.own_scores`, the self-teacher's
    computation), the hidden states themselves and, with `given`, the log-probs at those ids with
    the tail outside them. Zero sizes are scores of their shapes: no sample, no row, ids of width 0
    (no log-prob; the whole mass outside them: a tail of log 1 = 0); a sample of no rows in the
    other samples' dtype."""
    temperature, top_k, mode = plan.temperature, 0 if plan.top_k is VOCAB else plan.k, plan.invariant
    rows = [batch.response_rows(i) for i in range(len(batch))]
    states = in_one_dtype([s.reshape(-1, head.hidden_size) for s in states])
    hidden = torch.cat(states) if states else torch.zeros(0, head.hidden_size, dtype=head.dtype)
    tokens = torch.cat([ids[start:] for ids, start in zip(batch.sequences, batch.response_starts)]).long() \
        if len(batch) else torch.zeros(0, dtype=torch.int64)
    if hidden.shape[0] and top_k:
        token, top_ids, top_values, tail = head.own_scores(hidden, tokens, top_k, temperature, invariant=mode)
    elif hidden.shape[0]:  # the whole vocabulary: no buckets, the whole mass their tail (log 1)
        token = head.token_log_probs(hidden, tokens, temperature, invariant=mode).double()
        top_ids, top_values, tail = (torch.zeros(len(token), 0, dtype=torch.int64), torch.zeros(len(token), 0),
                                     torch.zeros(len(token)))
    else:  # no response row anywhere (the same batch on every rank of the head's group)
        token = torch.zeros(0, dtype=torch.float64)
        top_ids, top_values, tail = (torch.zeros(0, top_k, dtype=torch.int64), torch.zeros(0, top_k),
                                     torch.zeros(0))
    at = at_tail = None
    if given is not None:
        width = given[0].shape[1] if given else 0
        flat = torch.cat([g.long() for g in given]) if given else torch.zeros(0, 0, dtype=torch.int64)
        if hidden.shape[0] and width:  # the same on every rank of the head's group (one batch, one ids)
            values, rest = head.log_probs_at(hidden, flat, temperature, invariant=mode)
            at, at_tail = values.double(), rest.double()
        else:
            at = torch.zeros(hidden.shape[0], width, dtype=torch.float64)
            at_tail = torch.zeros(hidden.shape[0], dtype=torch.float64)
    return BatchScores(per_sample(token, rows), per_sample(top_ids.cpu(), rows),
                       per_sample(top_values.double().cpu(), rows), per_sample(tail.double().cpu(), rows),
                       hidden_states=list(states), ids_log_probs=None if at is None else per_sample(at, rows),
                       ids_tail_log_probs=None if at_tail is None else per_sample(at_tail, rows))


def in_one_dtype(states: list[torch.Tensor]) -> list[torch.Tensor]:
    """A sample of no rows in the dtype of the others' states (torch.cat would promote them)."""
    dtype = next((s.dtype for s in states if s.numel()), None)
    return [s if s.numel() or dtype is None else s.to(dtype) for s in states]


def per_sample(values: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
    """`values` [sum R_i, ...] cut into the samples' rows (no sample: none)."""
    return list(values.split(rows)) if rows else []
