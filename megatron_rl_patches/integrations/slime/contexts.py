"""slime's privileged contexts (`;context=KEY` teachers of top-k OPD): each sample's
`train_metadata[KEY]`, text or ids, carried from the rollout manager to the training ranks and read
there as the teacher step's per-sample contexts.

slime 624b824a hands `train_metadata` to its rollout manager's `_split_train_data_by_dp` as
`data["metadata"]` (one dict per sample), which copies a fixed list of keys into each rank's rollout
data, `metadata` not among them, and each rank's samples' `tokens` by reference. `split_wrapper`
(around it) hands each sample's tokens to slime carrying the sample's named keys (`CarriedTokens`),
so they reach the per-rank `tensorize_rollout_data_for_training` slime calls with each rank's
data; `tensorize_wrapper` (around it) takes them off, under `CONTEXTS`, and gives slime its tokens
back as they were: the state travels in slime's own arguments, through no module or context
variable. slime's `log_rollout_data` never sees them
(`opd.log_rollout_data_wrapper`). On the training ranks `step_contexts` reads them, tokenizes text
with the student's tokenizer (a key read by teachers of another tokenizer: theirs, its ids checked
against its vocabulary) and agrees a missing one over the job before any teacher is asked."""
from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from megatron_rl_patches.integrations.context_fields import field_contexts, tokenizer_vocab
from megatron_rl_patches.integrations.megatron.opd.opd_settings import (
    TEACHERS,
    OpdSettings,
    context_keys,
    key_tokenizer,
)
from megatron_rl_patches.integrations.megatron.opd.stage_host import batch_of, student_tokenizer_of
from megatron_rl_patches.integrations.megatron.opd.topk_request import CONTEXTS
from megatron_rl_patches.integrations.slime.fused_step import slime_settings
from megatron_rl_patches.integrations.slime.rollout_scores import carried_keys
from megatron_rl_patches.ops.agreement import world
from megatron_rl_patches.teachers.agreement import agree_failure
from megatron_rl_patches.teachers.context.teacher_context import checked_contexts

# slime's own key of the samples' train_metadata (a list of dicts), kept out of its metrics too
METADATA = "metadata"


def carried(data: Mapping, keys: Sequence[str]) -> list[dict]:
    """Per sample of the whole rollout the named keys of its train_metadata (a sample without one,
    or without a key, carries what it has: the training ranks name what is missing)."""
    samples = len(data["tokens"])
    metadata = data.get(METADATA) or [None] * samples
    return [{key: meta[key] for key in keys if key in meta} if isinstance(meta, Mapping) else {}
            for meta in metadata]


def check_layouts(args: Any, settings: OpdSettings) -> None:
    """A privileged teacher of another tokenizer or at its own layout under slime's `--allgather-cp`
    (more than one context-parallel rank), refused by name: its rows there are not checked against
    float64 yet (its zigzag context parallelism is; the student's tokenizer's privileged teachers
    are at both)."""
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    if not getattr(args, "allgather_cp", False) or cp < 2:
        return
    named = [t.path for t in settings.teachers if t.context is not None and (t.other_tokenizer or t.at_layout)]
    if named:
        raise ValueError(f"{TEACHERS}: teacher(s) {named} with ';context=KEY' of another tokenizer or at their own "
                         f"layout run under --allgather-cp at --context-parallel-size {cp}, which slime's OPD does "
                         "not score them at yet: drop --allgather-cp (megatron-core's zigzag context parallelism "
                         "takes them), or give the teacher the student's tokenizer and layout")


class CarriedTokens(Sequence):
    """One sample's `tokens` as slime's split sees them (their length, their items), carrying the
    sample's named train_metadata keys (`contexts`) to its rank's rollout data."""

    def __init__(self, tokens: Any, contexts: dict) -> None:
        self.tokens, self.contexts = tokens, contexts

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: Any) -> Any:
        return self.tokens[index]


def split_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for slime's `RolloutManager._split_train_data_by_dp(data)`: with teachers of
    a privileged context, every sample's tokens carry their keys of its train_metadata through the
    split (`CarriedTokens`), and so do the rows a rollout's served teachers gave; `data`'s tokens
    handed back as they were after it."""
    settings = slime_settings(getattr(instance, "args", None))
    data = kwargs["data"] if "data" in kwargs else args[0] if args else None
    keys = context_keys(settings) + carried_keys(settings, data)
    if not keys or not isinstance(data, MutableMapping) or "tokens" not in data:
        return wrapped(*args, **kwargs)
    tokens = data["tokens"]
    data["tokens"] = [CarriedTokens(one, contexts) for one, contexts in zip(tokens, carried(data, keys))]
    try:
        return wrapped(*args, **kwargs)
    finally:
        data["tokens"] = tokens


def tensorize_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for `tensorize_rollout_data_for_training(rollout_data)` as slime's rollout
    manager calls it per data-parallel rank: that rank's samples' contexts (carried by their tokens)
    added under `CONTEXTS`, the tokens slime's own again."""
    rollout_data = kwargs["rollout_data"] if "rollout_data" in kwargs else args[0] if args else None
    tokens = rollout_data.get("tokens") if isinstance(rollout_data, dict) else None
    if isinstance(rollout_data, dict) and isinstance(tokens, list) and \
            any(isinstance(one, CarriedTokens) for one in tokens):
        rollout_data[CONTEXTS] = [one.contexts if isinstance(one, CarriedTokens) else {} for one in tokens]
        rollout_data["tokens"] = [one.tokens if isinstance(one, CarriedTokens) else one for one in tokens]
    return wrapped(*args, **kwargs)


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
