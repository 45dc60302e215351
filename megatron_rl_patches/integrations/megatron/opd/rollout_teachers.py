"""Served teachers asked at the rollout, one sample at a time as its generation ends
(`MEGATRON_RL_PATCHES_OPD_SCORE_AT=rollout`; `score_at`), framework-free given the sample's tokens,
its response length and its privileged contexts: `RolloutTeachers` holds the served teachers of the
student's tokenizer on the top-k route (`rollout_entries`), their figures and the student's
tokenizer for text contexts; `ask_rows` sends one sample to every one of them, awaits the answers
without blocking the event loop's other samples and gives each teacher's rows packed under its key
(`carried_rows.packed`, `teacher_key`), which the host carries with the sample to its training
ranks. slime's rollout sample hook is the host today (`integrations.slime.rollout_scores`).

A teacher failing during the rollout (every replica down, the deadline passed, a sample too long)
fails the rollout with the same named error (`ServedTeacherError` / `ServedTeacherRefusal`) the
train step raises: a failure the client's retries and replicas did not absorb is no transient one,
and a rollout cannot leave a sample half-scored. A teacher of another tokenizer (`;tokenizer=DIR`)
or with a head (`;head=DIR`: its hidden states, 2H bytes a token) stays at the train step."""
# lazy imports: optional dependency httpx (the extra `served`), torch only where a teacher is asked
from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from megatron_rl_patches.integrations.megatron.opd.carried_rows import packed, teacher_key
from megatron_rl_patches.integrations.megatron.opd.opd_settings import SCORE_AT as SCORE_AT  # the setting's name
from megatron_rl_patches.integrations.megatron.opd.opd_settings import TEACHERS, OpdSettings
from megatron_rl_patches.integrations.megatron.opd.opd_settings import score_at as score_at  # its one parser
from megatron_rl_patches.teachers.entry import SERVED


def rollout_entries(settings: OpdSettings | None) -> list[Any]:
    """The entries asked at the rollout: served teachers of the student's tokenizer on the top-k
    route (no `;tokenizer=DIR`, no `;head=DIR`), where the settings ask for it (`score_at`)."""
    if settings is None or settings.full_vocab or settings.score_at != "rollout":
        return []
    return [t for t in settings.teachers if t.kind == SERVED and t.head is None and t.tokenizer is None]


class RolloutTeachers:
    """The served teachers the rollout asks (`rollout_entries`), their figures since the last
    `metrics()`, and the student's tokenizer for text contexts (read once). Pickled empty (a
    host's args travel between processes): the teachers are built again where the rollout runs."""

    def __init__(self, settings: OpdSettings | None, args: Any = None) -> None:
        self.args = args
        self.teachers: list[Any] = []
        self.contexts: list[str | None] = []  # each teacher's context key: its entry's, held here (the client has none)
        self.entries: list[Any] = []
        if rollout_entries(settings):
            from megatron_rl_patches.teachers.served.build import served_teacher_of  # lazy: import cost: httpx, torch

            assert settings is not None  # rollout_entries found some
            entries = rollout_entries(settings)
            self.teachers = [served_teacher_of(t.without_context(), settings.plan()) for t in entries]
            self.contexts = [t.context for t in entries]
            self.entries = entries
        self.samples = 0
        self.waited_s = 0.0
        self.tokenizer: Any = None

    @property
    def keys(self) -> list[str]:
        """Each teacher's key among a sample's carried rows."""
        return [teacher_key(teacher, key) for teacher, key in zip(self.teachers, self.contexts)]

    def __reduce__(self) -> tuple:
        return (empty_holder, ())

    def student_tokenizer(self) -> Any:
        if self.tokenizer is None:
            # lazy: import cost: torch and megatron's groups, only for text contexts
            from megatron_rl_patches.integrations.megatron.opd.stage_host import student_tokenizer_of

            self.tokenizer = student_tokenizer_of(self.args, f"{TEACHERS} (text contexts are tokenized by the "
                                                             "student's tokenizer)")
        return self.tokenizer

    def context_vocab(self, key: str) -> int | None:
        """The vocabulary a context under `key` is checked against before it is sent (as the train
        step checks it): the smallest of the entries with that key that name one (`;same_tokenizer;
        vocab=N` or `;config=PATH`), else the student's tokenizer's where `--hf-checkpoint` names it
        (a teacher of the student's tokenizer reads the student's ids); None: neither (the server
        checks)."""
        from megatron_rl_patches.teachers.named_vocab import named_vocab_size  # lazy: import cost: json only

        named = [named_vocab_size(t, f"{TEACHERS} entry '{t.path}'") for t in self.entries
                 if t.context == key and t.same_tokenizer]
        if named:
            return min(named)
        if not isinstance(getattr(self.args, "hf_checkpoint", None), str):
            return None
        from megatron_rl_patches.integrations.context_fields import tokenizer_vocab  # lazy: import cost: tokenizers

        return tokenizer_vocab(self.student_tokenizer())

    def sample_contexts(self, metadata: Any, index: Any, where: str,
                        field: str = "train_metadata") -> list[dict] | None:
        """A sample's privileged contexts (its metadata `field`, a mapping; `index`: its rollout index)
        for the teachers with a key (text tokenized by the student's tokenizer, as the training ranks
        read it: `context_fields.field_contexts`), one mapping, each checked as the train step checks
        it before anything is sent (ids, not empty, none negative, within the teacher's vocabulary:
        `context_vocab`), a refusal naming the sample and the key; None: no teacher has one."""
        keys = list(dict.fromkeys(key for key in self.contexts if key is not None))
        if not keys:
            return None
        from megatron_rl_patches.integrations.context_fields import field_contexts  # lazy: import cost: torch

        meta = metadata if isinstance(metadata, Mapping) else {}
        out = {}
        for key in keys:
            value, named = meta.get(key), f"{field}[{key!r}]"
            if value is None:
                raise ValueError(f"{where}: sample {index} has no {named} for the served teacher with "
                                 f"';context={key}' asked at the rollout: fill it in the rollout's generate function")
            tokenizer = self.student_tokenizer() if isinstance(value, str) else None
            (ids,) = field_contexts([value], key, where, tokenizer, self.context_vocab(key), samples=[index],
                                    field=named, ids="token ids")
            if not ids.numel() or int(ids.min()) < 0:
                what = "holds no ids" if not ids.numel() else f"holds a negative id ({int(ids.min())})"
                raise ValueError(f"{where}: sample {index}'s {named} {what}: the teacher reads the context's ids "
                                 "(its vocabulary indices) before the response; fill it in the rollout's generate "
                                 "function")
            out[key] = ids
        return [out]

    def metrics(self) -> dict[str, Any]:
        """The rollout's figures (`TeacherStep.metrics()`'s shape): samples scored, the seconds the
        hooks waited, the teachers' own summed (`step_metrics`)."""
        from megatron_rl_patches.teachers.step.metrics import step_metrics  # lazy: import cost: the step's module

        own = {"samples": self.samples, "hook_wait_s": self.waited_s}
        self.samples, self.waited_s = 0, 0.0
        return step_metrics(own, {i: teacher.metrics() for i, teacher in enumerate(self.teachers)})

    def close(self) -> None:
        for teacher in self.teachers:
            teacher.close()


def empty_holder() -> None:
    """What a pickled `RolloutTeachers` becomes: nothing (built again where it is used)."""
    return None


async def ask_rows(held: RolloutTeachers, tokens: Any, response: int, contexts: list[dict] | None, *,
                   sample: int = 0, where: str = "the rollout") -> dict[str, dict[str, Any]]:
    """One sample (`tokens`, its last `response` of them the response; `contexts`: its privileged
    contexts, one mapping, or None) sent to every teacher of `held` now: each teacher's rows packed
    under its key, the wait counted in `held`'s figures. A failure cancels what is still asked and
    raises the teacher's named error (or its deadline's), naming the sample by `sample` (its index
    in the rollout) and the host's hook by `where`."""
    import torch  # lazy: import cost: torch only where the rollout asks a teacher

    from megatron_rl_patches.teachers.batch import TeacherBatch  # lazy: import cost: torch
    from megatron_rl_patches.teachers.errors import ServedTeacherError
    from megatron_rl_patches.teachers.step.contexts import teacher_batches  # lazy: import cost: torch

    if isinstance(response, bool) or not isinstance(response, int) or not 0 < response < len(tokens):
        raise ValueError(f"{where}: sample {sample}'s response_length {response!r} is not within its "
                         f"{len(tokens)} tokens (the response is their last response_length, after a prompt of at "
                         "least one token): hand the hook the sample's whole prompt and response ids")
    ids = torch.tensor(list(tokens), dtype=torch.long)
    batch = TeacherBatch([ids], [len(ids) - response])
    try:
        asked = teacher_batches(held.teachers, held.contexts, batch, contexts, None)
    except (TypeError, ValueError) as error:  # the contexts are checked by the host first: the words of the last net
        raise type(error)(f"{where}: sample {sample}: {error}") from None
    started = time.perf_counter()
    pending = [teacher.submit(one, samples=[sample]) for teacher, one in zip(held.teachers, asked)]
    futures: list[asyncio.Future] = []
    try:
        futures = [asyncio.wrap_future(f) for waiting in pending for f in waiting.pending.values()]
        # each sample's requests answered while the other samples' tasks run; a teacher that refused the
        # sample before sending it (too long, its server down at the first ask) raised at once, unwaited
        if futures and not any(waiting.failure is not None for waiting in pending):
            await asyncio.wait(futures, timeout=max(min(p.deadline.remaining() for p in pending), 0.0),
                               return_when=asyncio.FIRST_EXCEPTION)
        for waiting in pending:  # a failed teacher's error first: another's result() would wait for its answer
            if failed_already(waiting):
                waiting.result()
        scores = [waiting.result() for waiting in pending]  # the named error of a failure, or its deadline
    except BaseException as failed:
        for waiting in pending:
            waiting.cancel()
        for future in futures:  # the loop's wrappers of the stopped requests, never awaited again: not logged
            future.cancel()
        if isinstance(failed, ServedTeacherError):  # where it was asked before the teacher's own words
            raise type(failed)(f"{where}: {failed}", failed.url, failed.sample) from failed
        raise
    held.waited_s += time.perf_counter() - started
    held.samples += 1
    return {key: packed(got, one) for key, got, one in zip(held.keys, scores, asked)}


def failed_already(waiting: Any) -> bool:
    """Whether a teacher's `PendingScores` holds a failure now: refused before sending, or a
    request that ended in an error."""
    return waiting.failure is not None or any(f.done() and not f.cancelled() and f.exception() is not None
                                              for f in waiting.pending.values())
