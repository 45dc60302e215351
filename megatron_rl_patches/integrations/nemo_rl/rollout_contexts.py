"""A privileged teacher's contexts in NeMo-RL: each sample's batch field KEY of the rollout batch.

NeMo-RL 7ea279ab's `distillation_train` builds the teacher's `train_data` from the rollout's
message logs with a fixed set of keys (input_ids, input_lengths, token_mask, sample_mask), so a
dataset's own field never reaches `get_topk_logits`. The rollout functions it calls
(`run_multi_turn_rollout`, `run_async_multi_turn_rollout`, `run_nemo_gym_rollout_sync`) take the
repeated batch as `input_batch`, in the order `train_data` keeps: `rollout_contexts` wraps them
to read the field there (`batch[KEY]`, one entry per sample, or each sample's
`extra_env_info[KEY]`, where NeMo-RL's collate keeps a datum's own data) before the rollout
runs, for the next `get_topk_logits`."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

ROLLOUTS = ("run_multi_turn_rollout", "run_async_multi_turn_rollout", "run_nemo_gym_rollout_sync")
WHO = "ServedTeacherPolicy"  # the teacher policy a refusal names, unless its caller names its own


def batch_contexts(batch: Any, key: str, who: str = WHO) -> list[Any]:
    """Each sample's value under `key`: the batch's field, else each sample's extra_env_info.
    Refusals name `who` (the teacher policy reading them)."""
    where = f"{who} (NeMo-RL's rollout batch)"
    size = len(batch["message_log"]) if "message_log" in batch else None
    if key in batch:
        values = list(batch[key])
        if size is not None and len(values) != size:
            raise ValueError(f"{where}: the batch field {key!r} holds {len(values)} values for {size} samples: give "
                             "one per sample")
        return values
    infos = batch["extra_env_info"] if "extra_env_info" in batch else None
    if infos is None:
        raise ValueError(f"{where}: the teacher has context={key!r} and the rollout batch has no field {key!r} and no "
                         f"extra_env_info (it has {sorted(map(str, batch))}): put each sample's privileged context "
                         f"in its datum's extra_env_info[{key!r}]")
    values = []
    for sample, info in enumerate(infos):
        if not isinstance(info, dict) or key not in info:
            held = sorted(map(str, info)) if isinstance(info, dict) else type(info).__name__
            raise ValueError(f"{where}: sample {sample} has no context under {key!r} (context={key!r}; its "
                             f"extra_env_info holds {held}): put every sample's privileged context there")
        values.append(info[key])
    return values


def remembering(rollout: Callable[..., Any], key: str, keep: Callable[[list[Any]], None],
                who: str = WHO) -> Callable[..., Any]:
    """`rollout` that first reads each sample's context from its `input_batch` and keeps it (its
    refusals naming `who`, the teacher policy)."""

    @functools.wraps(rollout)
    def run(*args: Any, **kwargs: Any) -> Any:
        batch = kwargs.get("input_batch")
        if batch is None:
            raise ValueError(f"{who} (NeMo-RL's rollout batch): {rollout.__name__} was called without input_batch="
                             "...; the privileged teacher reads each sample's context from it (NeMo-RL 7ea279ab "
                             "passes it by name)")
        keep(batch_contexts(batch, key, who))
        return rollout(*args, **kwargs)

    return run
