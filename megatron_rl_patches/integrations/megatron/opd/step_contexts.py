"""Each sample's privileged contexts (`;context=KEY` teachers of top-k OPD) as the training ranks read
them from a pipelined Megatron actor's rollout data: per sample a dict under `CONTEXTS` (a host's
split carried them there: slime's `integrations.slime.contexts`), else the samples' own
`METADATA` (slime's train_metadata, where a host hands it itself). Text is tokenized with the
student's tokenizer (a key read by teachers of another tokenizer: theirs, its ids checked against
its vocabulary); a missing or bad one is agreed over the job before any teacher is asked."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_rl_patches.integrations.context_fields import field_contexts, tokenizer_vocab
from megatron_rl_patches.integrations.megatron.opd.opd_settings import (
    TEACHERS,
    OpdSettings,
    context_keys,
    key_tokenizer,
)
from megatron_rl_patches.integrations.megatron.opd.stage_host import batch_of, student_tokenizer_of
from megatron_rl_patches.integrations.megatron.opd.topk_request import CONTEXTS, METADATA
from megatron_rl_patches.ops.agreement import world
from megatron_rl_patches.teachers.agreement import agree_failure
from megatron_rl_patches.teachers.context.teacher_context import checked_contexts

MISSING = ("slime_opd: the rollout data reached train_actor without the samples' contexts: run slime's rollout "
           "manager with MEGATRON_RL_PATCHES and {teachers} in the job's runtime_env (not only --train-env-vars), "
           "so that its split carries each sample's train_metadata keys to the training ranks")


def step_contexts(args: Any, rollout_data: dict, settings: OpdSettings, vocab_size: int | None = None,
                  group: Any = None) -> list[dict] | None:
    """Per sample of this rank's rollout `{KEY: 1-D int64 ids}` for every context key of the
    teachers (None: no teacher has one); text tokenized by the student's tokenizer (slime's
    --hf-checkpoint), each checked as `teachers.with_context` checks it (non-empty, ids within
    `vocab_size`, the student's), nothing built: the teacher step builds each teacher's batch once.
    A missing or bad one on any rank is the same error on every rank of `group` (the job by
    default; one all-gather, before any teacher is asked), the sample and key named."""
    keys = context_keys(settings)
    if not keys:
        return None
    error: BaseException | None = None
    contexts: list[dict] = []
    try:
        contexts = read_contexts(args, rollout_data, keys, settings)
        batch = batch_of(rollout_data)
        for key in keys:
            own = key_tokenizer(settings, key)
            try:
                checked_contexts(batch, [one[key] for one in contexts],
                                 vocab_size=vocab_size if own is None else tokenizer_vocab(own))
            except (TypeError, ValueError) as bad:
                raise type(bad)(f"slime_opd: train_metadata[{key!r}]: {bad}") from None
    except (TypeError, ValueError) as caught:
        error = caught
    agree_failure(error, group if group is not None else world(), what="slime_opd: the privileged contexts")
    return contexts


def read_contexts(args: Any, rollout_data: dict, keys: list[str], settings: OpdSettings) -> list[dict]:
    """`step_contexts` on this rank alone (raises the first problem found): each key's values read
    by the one adapter of a framework's fields (`context_fields.field_contexts`)."""
    samples = len(rollout_data["tokens"])
    given = rollout_data.get(CONTEXTS)
    if given is None:  # a slime that hands the train_metadata itself
        given = rollout_data.get(METADATA)
    if given is None:
        raise ValueError(MISSING.format(teachers=TEACHERS))
    if len(given) != samples:
        raise ValueError(f"slime_opd: the rollout data holds {len(given)} samples' contexts for {samples} samples")
    partition = rollout_data.get("partition")
    names = [int(partition[i]) if partition is not None else i for i in range(samples)]
    for i, meta in enumerate(given):
        for key in keys:
            if not isinstance(meta, Mapping) or meta.get(key) is None:
                users = [t.path for t in settings.teachers if t.context == key]
                held = sorted(map(str, meta)) if isinstance(meta, Mapping) else []
                raise ValueError(f"slime_opd: sample {names[i]} (rollout index) has no train_metadata[{key!r}] for "
                                 f"the teacher(s) {users} with ';context={key}' (its train_metadata holds {held}): "
                                 "fill it for every sample in the rollout's generate function")
    out: list[dict] = [{} for _ in range(samples)]
    for key in keys:
        values = [meta[key] for meta in given]
        tokenizer = None
        if any(isinstance(value, str) for value in values):  # loaded only for text contexts
            own = key_tokenizer(settings, key)
            tokenizer = student_tokenizer_of(args, f"{TEACHERS} (text contexts are tokenized by the student's "
                                                   "tokenizer)") if own is None else own
        for i, ids in enumerate(field_contexts(values, key, "slime_opd", tokenizer, samples=names,
                                               field=f"train_metadata[{key!r}]", ids="token ids")):
            out[i][key] = ids
    return out
