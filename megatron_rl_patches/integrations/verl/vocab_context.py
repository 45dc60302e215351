"""The privileged context on verl's whole-vocabulary route (`;head=DIR;context=KEY`): the trainer's
micro-batch carries each sample's non-tensor field KEY (verl's `DataProto.to_tensordict` keeps a
non-tensor batch field as a per-sample stack), and the pooling server is asked for the states of
`context_i + response_i` (the response: the ids after the sample's prompt, as verl's agent loop
hands them to the teacher), so the teacher's row r still predicts the student's response token r
and lines up with the student's row for it.

Text contexts are tokenized by the teacher's tokenizer (`;tokenizer=DIR`, else the head's
directory); every refusal names the sample and the key; the ranks of the tensor-parallel group
agree it before the server is asked."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches.integrations.context_fields import privileged_batch
from megatron_rl_patches.integrations.verl.rows import response_lengths
from megatron_rl_patches.settings import VERL_TEACHER
from megatron_rl_patches.teachers.agreement import agree_failure
from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.entry import TeacherEntry

WHERE = f"verl_topk_kd ({VERL_TEACHER} with head= and context=)"


def field_values(batch: Any, key: str) -> list[Any] | None:
    """The micro-batch's per-sample non-tensor field `key` (verl keeps it as a per-sample stack;
    None: absent)."""
    if key not in batch.keys():
        return None
    stack = batch.get(key)
    return list(stack.tolist() if hasattr(stack, "tolist") else stack)


def trainer_values(batch: Any, key: str) -> list[Any]:
    """Each sample's value of the trainer's micro-batch field `key`, a missing field named."""
    values = field_values(batch, key)
    if values is None:
        keys = sorted(str(name) for name in batch.keys())
        raise ValueError(f"{WHERE}: the trainer's micro-batch has no non-tensor field {key!r} (context={key!r}; its "
                         f"fields are {keys}): keep each sample's privileged context in the batch's non-tensor field "
                         f"{key!r} (verl drops the dataset's non-tensor fields from the training batch when reward "
                         "loop workers score it: name a field verl keeps, e.g. one its agent loop's extra fields set)")
    return values


def prompt_lengths(batch: Any, starts: list[int]) -> list[int]:
    """Per sequence, where its response begins: its length less its response's (verl's `responses`),
    else the first row the loss reads (`starts`)."""
    lengths = [int(n) for n in batch["input_ids"].offsets().diff().tolist()]
    responses = response_lengths(batch)
    if responses is None:
        return list(starts)
    return [length - response for length, response in zip(lengths, responses)]


def context_batch(entry: TeacherEntry, batch: Any, student: TeacherBatch, vocab_size: int) -> TeacherBatch:
    """The teacher's batch: sample i's context, then its ids from the end of its prompt on; its
    response start moved so that row r still predicts the token the student's row r predicts."""
    key = entry.context
    assert key is not None
    prompts = prompt_lengths(batch, student.response_starts)
    for sample, (prompt, start) in enumerate(zip(prompts, student.response_starts)):
        if start < prompt:
            raise ValueError(f"{WHERE}: sample {sample}'s loss reads row {start - 1}, inside its prompt of {prompt} "
                             "ids, which the context replaces: mask the prompt out of the loss")
    responses = TeacherBatch(student.sequences, [max(p, 1) for p in prompts])
    privileged = privileged_batch(responses, trainer_values(batch, key), key, WHERE, entry.tokenizer or entry.head,
                                  vocab_size)
    shifted = [start + len(sequence) - len(own) for sequence, own, start in
               zip(privileged.sequences, student.sequences, student.response_starts)]
    return TeacherBatch(privileged.sequences, shifted)


def agreed_privileged_batch(entry: TeacherEntry, batch: Any, student: TeacherBatch, vocab_size: int,
                            group: Any) -> TeacherBatch:
    """`context_batch`, a refusal on any rank of the tensor-parallel `group` raised on every rank
    (agreed before the server is asked and before the forward's first collective)."""
    error: Exception | None = None
    scored = student
    try:
        scored = context_batch(entry, batch, student, vocab_size)
    except (TypeError, ValueError) as refused:
        error = refused
    agree_failure(error, group, own=True)
    return scored

