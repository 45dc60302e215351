"""`verl_topk_kd`'s served teacher: verl's teacher-loop client asks the package's `ServedTeacher`.

verl 0.9.1's agent loop asks `AsyncTeacherLLMServerManager.compute_teacher_logprobs_single`
(`verl/experimental/teacher_loop/teacher_manager.py`) for one unpadded sequence's teacher rows:
[L, K] ids (int32) and log-probs (float32), row r the teacher's top-k at the position that predicts
token r + 1, the last row a dummy of zeros (verl's vLLM adapter drops prompt_logprobs[0] and pads
one row at the end); K = 1 (the token's own log-prob) without `use_topk`. verl pads those rows
into the batch, and `verl_topk_kd`'s exact tail reads them (a row of repeated ids, the dummy or
the padding, gives 0).

With MEGATRON_RL_PATCHES_VERL_TEACHER=`http(s)://host:port;engine=vllm` the same rows come from
that server through `ServedTeacher` (the engine's own top-k, K within its --max-logprobs; the
replicas of one teacher as URLs joined by '|', spread and failed over by the client); with
`;head=DIR` (the teacher's Hugging Face directory, readable where verl's agent loop runs) the
server is a vLLM pooling server and the rows are its final hidden states through the teacher's
head in the agent-loop process: any K (above --max-logprobs), only [L, K] rows in verl's batch.
Unset, verl's own teacher replicas answer as before. verl still places and starts its own teacher
replicas from its config (Ray): this patch changes who answers, not what verl starts.

With `;context=KEY` the teacher is privileged: for each sample it scores the sample's non-tensor
batch field KEY (ids, or text tokenized by the teacher's tokenizer `;tokenizer=DIR`, else the
head's directory) followed by the student's response ids (`teachers.with_context`); verl's rows on
the response are the teacher's on that sequence, the prompt's rows repeated zeros (read as 0, as
verl's dummy row). verl's agent-loop worker holds the sample's fields: its call for the sample's
teacher rows (`AgentLoopWorker._compute_teacher_logprobs`) is answered by the patch's wrapper,
which passes them to the served teacher as arguments; a missing field, text without a tokenizer,
ids past the vocabulary, or a sample past the server's max model length is refused naming the
sample's prompt length and the key, before anything is sent. The live self-teacher's entry
(`student;context=KEY`) is scored on the trainer (`self_teacher`): here the agent loop stores zero
rows of verl's layout in its place and asks nobody.

The variable is read once per teacher client and agent-loop worker (`entry.verl_teacher`, held by
each) and passed down as a `VerlTeacher`; each served teacher is built once
per teacher client (verl's `AsyncTeacherLLMServerManager`, which holds it: `held`) through the one
construction from an entry (`teachers.served.build.served_teacher_of`)."""
from __future__ import annotations

import asyncio
from typing import Any

import torch

from megatron_rl_patches._log import warn_once
from megatron_rl_patches.integrations.context_fields import field_contexts, tokenizer_vocab
from megatron_rl_patches.integrations.verl.entry import VerlTeacher, verl_teacher
from megatron_rl_patches.integrations.verl.held import held
from megatron_rl_patches.integrations.verl.self_entry import placeholder_rows
from megatron_rl_patches.model.arguments import bind
from megatron_rl_patches.ops.scoring_plan import ScoringPlan
from megatron_rl_patches.settings import VERL_TEACHER
from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.context.teacher_context import with_context
from megatron_rl_patches.teachers.entry import TeacherEntry
from megatron_rl_patches.teachers.redaction import redacted

# the sample verl's agent-loop worker is scoring: (its prompt length, its non-tensor fields)
Sample = tuple[int, dict[str, Any]]


def served_teacher(manager: Any, raw: str, entry: TeacherEntry, k: int) -> Any:
    """The `ServedTeacher` of `entry` (the variable's value `raw`, read) scoring `k` buckets per row,
    built once per verl teacher client `manager` and held by it."""
    from megatron_rl_patches.teachers.served.build import served_teacher_of  # lazy: optional dependency httpx

    teachers: dict[tuple[str, int], Any] = held(manager, "served_teachers", dict)
    teacher = teachers.get((raw, k))
    if teacher is None:
        teacher = teachers[(raw, k)] = served_teacher_of(entry, ScoringPlan(k))  # verl's K, its loss config's
    return teacher


def verl_rows(teacher: Any, sequence_ids: list[int], k: int,
              context: torch.Tensor | None = None, prompt_length: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's teacher rows of one sequence from `teacher`: ids [L, max(k, 1)] int32 and log-probs
    [L, max(k, 1)] float32, row r predicting token r + 1 (its top-k best first; k = 0: the token
    itself and its log-prob), the last row zeros, as verl's vLLM adapter returns them. With a
    `context` the teacher scores it followed by the response (the ids from `prompt_length` on):
    the response's rows are its, the prompt's repeated zeros."""
    ids = torch.as_tensor(list(sequence_ids), dtype=torch.long)
    if ids.ndim != 1 or len(ids) < 2:
        raise ValueError(f"{VERL_TEACHER}: a sequence of {len(ids)} ids has no row to score (verl asks for "
                         "prompt + response ids, at least 2)")
    batch = TeacherBatch([ids], [prompt_length if context is not None else 1])
    scored = batch if context is None else with_context(batch, [context], vocab_size=teacher_vocab(teacher))
    scores = teacher.score(scored)
    first = batch.response_starts[0] - 1
    if k:
        top_ids, log_probs = scores.topk_ids[0], scores.topk_log_probs[0]
    else:
        top_ids, log_probs = ids[first + 1:, None], scores.token_log_probs[0][:, None]
    width = top_ids.shape[1]
    before, dummy = torch.zeros(first, width), torch.zeros(1, width)
    return (torch.cat([before.long(), top_ids, dummy.long()]).to(torch.int32),
            torch.cat([before, log_probs.float(), dummy]))


def teacher_vocab(teacher: Any) -> int | None:
    """The teacher's vocabulary where the trainer knows it: its head's."""
    head = getattr(teacher, "head", None)
    return head.vocab_size if head is not None else None


def sample_context(entry: TeacherEntry, sequence_ids: list[int], sample: Sample | None) -> tuple[torch.Tensor, int]:
    """The privileged context of the `sample` verl's agent-loop worker is scoring, and its prompt
    length (refusals name the key and the sample)."""
    key = entry.context
    if sample is None:
        raise ValueError(f"{VERL_TEACHER}: context={key!r} reads the sample's non-tensor batch fields, which verl's "
                         "agent-loop worker (AgentLoopWorker._compute_teacher_logprobs) hands over; this call came "
                         "from elsewhere: apply verl_topk_kd in the agent-loop process")
    prompt_length, fields = sample
    said = f"the sample with a prompt of {prompt_length} ids (of {len(sequence_ids)})"
    if key not in fields:
        raise ValueError(f"{VERL_TEACHER}: {said} has no non-tensor batch field {key!r} (context={key!r}; its fields "
                         f"are {sorted(map(str, fields))}): put each sample's privileged context in that field")
    tokenizer = entry.tokenizer or entry.head
    vocab = tokenizer_vocab(tokenizer) if tokenizer is not None else None
    try:
        return field_contexts([fields[key]], key, VERL_TEACHER, tokenizer, vocab, samples=[said])[0], prompt_length
    except ValueError as error:
        if "no teacher tokenizer" not in str(error):
            raise
        raise ValueError(f"{error} (add ';tokenizer=DIR' to {VERL_TEACHER})") from None


def served_k(manager: Any) -> int:
    """verl's K for the teacher's rows: its loss config's topk with use_topk, else 0 (as verl's
    `_get_teacher_sampling_params` asks vLLM)."""
    loss = manager.distillation_loss_config
    return int(loss.topk) if loss.loss_settings.use_topk else 0


def check_call(manager: Any, arguments: dict[str, Any]) -> None:
    """What a served teacher cannot answer, refused naming the variable: images, video or audio
    (it scores ids), several teachers (the variable names one)."""
    media = [name for name, value in (arguments.get("multi_modal_data") or {}).items() if value is not None]
    if media:
        raise ValueError(f"{VERL_TEACHER}: a served teacher scores token ids only, and this sample carries "
                         f"{sorted(media)}; unset {VERL_TEACHER} to let verl's own teacher replicas score it")
    if len(manager.teacher_model_configs) != 1:
        raise ValueError(f"{VERL_TEACHER} names one served teacher, and verl's distillation config has "
                         f"{len(manager.teacher_model_configs)} ({sorted(manager.teacher_model_configs)}); unset it, "
                         "or configure one teacher")


async def served_rows(manager: Any, arguments: dict[str, Any], named: VerlTeacher,
                      sample: Sample | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`compute_teacher_logprobs_single`'s result from the teacher the variable names (`named`, read
    at the door; the blocking HTTP requests in a worker thread, so the agent loop's event loop keeps
    running); `sample`: the one verl's agent-loop worker is scoring, for a `;context=KEY` entry."""
    check_call(manager, arguments)
    k = served_k(manager)
    sequence = list(arguments["sequence_ids"])
    entry = named.served
    if entry is None:  # the live self-teacher: scored on the trainer, nothing asked here
        return placeholder_rows(sequence, k)
    context, prompt_length = sample_context(entry, sequence, sample) if entry.context is not None else (None, 1)
    teacher = served_teacher(manager, named.raw, entry, max(k, 1))
    return await asyncio.to_thread(verl_rows, teacher, sequence, k, context, prompt_length)


def compute_teacher_logprobs_single_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for `verl_topk_kd` on verl's teacher client: the served teacher answers when
    MEGATRON_RL_PATCHES_VERL_TEACHER names one, verl's replicas otherwise."""
    named = verl_teacher(instance)
    bound = bind(wrapped, args, kwargs)
    if named.entry is None or bound is None:
        return wrapped(*args, **kwargs)
    warn_once(f"verl_topk_kd: verl's teacher rows come from the served teacher {redacted(named.raw)} "
              f"({VERL_TEACHER}), not verl's teacher replicas")
    return served_rows(instance, dict(bound.arguments), named)


def compute_teacher_logprobs_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for `verl_topk_kd` on verl's agent-loop worker: with a served `;context=KEY`
    entry, the worker's call answered here, the sample's prompt length and non-tensor fields passed
    to the teacher (`privileged_rows`); every other call is verl's own."""
    named = verl_teacher(instance)
    bound = bind(wrapped, args, kwargs)
    if named.served is None or named.served.context is None or bound is None:
        return wrapped(*args, **kwargs)
    return privileged_rows(wrapped, instance, args, kwargs, dict(bound.arguments), named)


async def privileged_rows(wrapped: Any, worker: Any, args: tuple, kwargs: dict, arguments: dict[str, Any],
                          named: VerlTeacher) -> Any:
    """`AgentLoopWorker._compute_teacher_logprobs(output, prompt_ids, response_ids, validate,
    sample_kwargs)` for a served privileged teacher: what verl's own method does (distillation on,
    not validating: the sample's teacher rows in `output.extra_fields`), its teacher client's call
    made with the sample passed along (`served_rows`)."""
    if not getattr(worker, "distillation_enabled", False) or arguments.get("validate"):
        return await wrapped(*args, **kwargs)
    output = arguments["output"]
    prompt, response = list(arguments.get("prompt_ids") or []), list(arguments.get("response_ids") or [])
    sample = (len(prompt), dict(arguments.get("sample_kwargs") or {}))
    call = {"sequence_ids": prompt + response, "multi_modal_data": getattr(output, "multi_modal_data", None)}
    ids, log_probs = await served_rows(worker.teacher_server_manager, call, named, sample)
    output.extra_fields["teacher_ids"] = ids
    output.extra_fields["teacher_logprobs"] = log_probs
    return None
