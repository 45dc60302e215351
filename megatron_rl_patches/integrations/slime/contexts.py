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
(`opd.log_rollout_data_wrapper`). On the training ranks `integrations.megatron.opd.step_contexts`
reads them (under `CONTEXTS`, else slime's own `metadata`)."""
from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from megatron_rl_patches.integrations.megatron.opd.opd_settings import TEACHERS, OpdSettings, context_keys
from megatron_rl_patches.integrations.megatron.opd.rollout_teachers import carried_keys
from megatron_rl_patches.integrations.megatron.opd.topk_request import CONTEXTS, METADATA
from megatron_rl_patches.integrations.slime.fused_step import slime_settings
from megatron_rl_patches.model.arguments import argument


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
    data = argument("data", 0, args, kwargs)
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
    rollout_data = argument("rollout_data", 0, args, kwargs)
    tokens = rollout_data.get("tokens") if isinstance(rollout_data, dict) else None
    if isinstance(rollout_data, dict) and isinstance(tokens, list) and \
            any(isinstance(one, CarriedTokens) for one in tokens):
        rollout_data[CONTEXTS] = [one.contexts if isinstance(one, CarriedTokens) else {} for one in tokens]
        rollout_data["tokens"] = [one.tokens if isinstance(one, CarriedTokens) else one for one in tokens]
    return wrapped(*args, **kwargs)
