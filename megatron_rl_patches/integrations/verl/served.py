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
replicas from its config (Ray): this patch changes who answers, not what verl starts."""
from __future__ import annotations

import asyncio
import os
import threading
from typing import Any, NamedTuple

import torch

from megatron_rl_patches._args import bind
from megatron_rl_patches._log import warn_once
from megatron_rl_patches._variables import VERL_TEACHER
from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.engines.names import check_engine
from megatron_rl_patches.teachers.redaction import has_userinfo, redacted
from megatron_rl_patches.teachers.replica_urls import SEPARATOR, replica_urls

FORM = "http(s)://host:port[|http(s)://host:port...];engine=vllm[;head=DIR]"
_TEACHERS: dict[tuple[str, int], Any] = {}  # (entry, K) -> ServedTeacher, one per agent-loop process
_LOCK = threading.Lock()


class Entry(NamedTuple):
    """MEGATRON_RL_PATCHES_VERL_TEACHER's value read: the URL, the engine, the head's directory (or None)."""

    url: str
    engine: str
    head: str | None = None


def parse_entry(entry: str) -> Entry:
    """(url, engine, head) of MEGATRON_RL_PATCHES_VERL_TEACHER's value; ValueError naming the
    variable for anything else."""
    from megatron_rl_patches.teachers.http_client import check_url  # lazy: optional dependency httpx

    said = redacted(entry)
    if has_userinfo(entry):
        raise ValueError(f"{VERL_TEACHER}={said!r}: the URL carries a user or password; drop it and put the API key "
                         f"in MEGATRON_RL_PATCHES_TEACHER_API_KEY (sent as a bearer token)")
    url, *options = (part.strip() for part in entry.split(";"))
    engine = head = None
    for option in options:
        name, _, value = (part.strip() for part in option.partition("="))
        if name == "engine" and engine is None:
            engine = value
        elif name == "head" and head is None:
            if not value:
                raise ValueError(f"{VERL_TEACHER}={said!r}: head= names the teacher's Hugging Face directory (its "
                                 f"output layer is read where verl's agent loop runs); the form is {FORM}")
            head = value
        else:
            raise ValueError(f"{VERL_TEACHER}={said!r}: option {option!r} is unknown or given twice; the form is "
                             f"{FORM}")
    if engine is None:
        raise ValueError(f"{VERL_TEACHER}={said!r}: name the engine serving it, e.g. '{url};engine=vllm'")
    try:
        return Entry(SEPARATOR.join(check_url(one) for one in replica_urls(url)), check_engine(engine), head)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{VERL_TEACHER}={said!r}: {exc}") from None


def served_teacher(entry: str, k: int) -> Any:
    """The `ServedTeacher` of `entry` scoring `k` buckets per row, built once per process."""
    from megatron_rl_patches.teachers.served import ServedTeacher  # lazy: optional dependency httpx

    with _LOCK:
        teacher = _TEACHERS.get((entry, k))
        if teacher is None:
            url, engine, head = parse_entry(entry)
            teacher = _TEACHERS[(entry, k)] = ServedTeacher(url, engine, top_k=k, head=head)
        return teacher


def verl_rows(teacher: Any, sequence_ids: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's teacher rows of one sequence from `teacher`: ids [L, max(k, 1)] int32 and log-probs
    [L, max(k, 1)] float32, row r predicting token r + 1 (its top-k best first; k = 0: the token
    itself and its log-prob), the last row zeros, as verl's vLLM adapter returns them."""
    ids = torch.as_tensor(list(sequence_ids), dtype=torch.long)
    if ids.ndim != 1 or len(ids) < 2:
        raise ValueError(f"{VERL_TEACHER}: a sequence of {len(ids)} ids has no row to score (verl asks for "
                         "prompt + response ids, at least 2)")
    scores = teacher.score(TeacherBatch([ids], [1]))
    if k:
        top_ids, log_probs = scores.topk_ids[0], scores.topk_log_probs[0]
    else:
        top_ids, log_probs = ids[1:, None], scores.token_log_probs[0][:, None]
    width = top_ids.shape[1]
    dummy = torch.zeros(1, width)
    return (torch.cat([top_ids, dummy.long()]).to(torch.int32),
            torch.cat([log_probs.float(), dummy]))


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


async def served_rows(manager: Any, arguments: dict[str, Any], entry: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`compute_teacher_logprobs_single`'s result from the served teacher at `entry` (the blocking
    HTTP requests in a worker thread, so the agent loop's event loop keeps running)."""
    check_call(manager, arguments)
    k = served_k(manager)
    teacher = served_teacher(entry, max(k, 1))
    return await asyncio.to_thread(verl_rows, teacher, list(arguments["sequence_ids"]), k)


def compute_teacher_logprobs_single_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for `verl_topk_kd` on verl's teacher client: the served teacher answers when
    MEGATRON_RL_PATCHES_VERL_TEACHER names one, verl's replicas otherwise."""
    entry = os.environ.get(VERL_TEACHER, "").strip()
    bound = bind(wrapped, args, kwargs)
    if not entry or bound is None:
        return wrapped(*args, **kwargs)
    warn_once(f"verl_topk_kd: verl's teacher rows come from the served teacher {redacted(entry)} ({VERL_TEACHER}), "
              "not verl's teacher replicas")
    return served_rows(instance, dict(bound.arguments), entry)
