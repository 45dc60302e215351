"""slime's dynamic micro-batches counted in the tokens the model computes (issue 111, item 7).

With `--use-dynamic-batch-size --max-tokens-per-gpu N`, slime's rollout manager packs each step's
samples first-fit by length (`slime.utils.dp_schedule` calls `first_fit_pack(step_lengths, N * cp_size)`).
With shared-prefix packing on, N counts computed tokens: the samples are packed as
`shared_prefix_micro_batches` packs them (a group whole where it fits; a sample longer than N alone),
so a shared prompt's memory buys more samples per micro-batch (8 groups of 8 samples at P = 1,024,
R = 128, N = 9,216: 8 micro-batches counted whole, 2 as computed). Where the step plans its
micro-batches together (`hold_steps`; `step_held_cost` from slime's args), the first fit cuts next-fit
in trie order instead (`held_cost=`): a cut group in consecutive micro-batches, each segment counted
once per step, its held rows at `held_cost` of a computed row.

slime's first fit sees lengths without tokens, so three doors carry them in slime's own arguments: the
split (`RolloutManager._split_train_data_by_dp`) hands the schedule rollout ids that hold the tokens
(`RolloutIds`, as `rollout_indices`), the schedule (`build_dp_schedule`) hands the first fit lengths
that know their tokens (`SampleLength`, an int), and the first fit packs by those; all else runs as slime's."""
from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

from megatron_rl_patches.integrations.megatron.shared_prefix_step_pass import step_held_cost
from megatron_rl_patches.integrations.slime.fused_step import held_settings
from megatron_rl_patches.model.arguments import argument
from megatron_rl_patches.shared_prefix.micro_batches import physical_micro_batches, sample_ids, step_micro_batches


class RolloutIds(list):
    """slime's rollout ids of the samples (`data["rollout_ids"]`, the list slime's split hands its
    schedule as `rollout_indices`) holding the rollout's `tokens` too."""

    def __init__(self, ids: Sequence[Any], tokens: Sequence[Any]) -> None:
        super().__init__(ids)
        self.tokens = tokens


class SampleLength(int):
    """A sample's token count (slime sums and compares it as the int it is) that knows which
    sample of the rollout's data it counts (`index`) and, handed on by a split, the rollout's
    tokens (`tokens`; None: a length that knows no tokens) and what a held row costs where the step
    holds segments (`held_cost`; None: each micro-batch planned on its own)."""

    index: int
    tokens: Sequence[Any] | None
    held_cost: float | None

    def __new__(cls, length: int, index: int, tokens: Sequence[Any] | None = None,
                held_cost: float | None = None) -> SampleLength:
        counted = super().__new__(cls, length)
        counted.index, counted.tokens, counted.held_cost = index, tokens, held_cost
        return counted


def split_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for slime's `RolloutManager._split_train_data_by_dp(data)`: with shared-prefix
    packing on, the samples' rollout ids slime's schedule is handed hold the rollout's tokens
    (`RolloutIds`); `data`'s own list back after the split."""
    data = argument("data", 0, args, kwargs)
    sharing = held_settings(getattr(instance, "args", None)).shared_prefix
    if not sharing or not isinstance(data, MutableMapping) or "tokens" not in data or "rollout_ids" not in data:
        return wrapped(*args, **kwargs)
    ids = data["rollout_ids"]
    data["rollout_ids"] = RolloutIds(ids, data["tokens"])
    try:
        return wrapped(*args, **kwargs)
    finally:
        data["rollout_ids"] = ids


def schedule_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for `build_dp_schedule(args, train_parallel_config, total_lengths, *, ...,
    rollout_indices)` as slime's rollout module calls it: rollout ids that hold the rollout's tokens
    (a split's, `RolloutIds`), each length handed on as a `SampleLength` of its sample's tokens."""
    ids = kwargs.get("rollout_indices")
    lengths = argument("total_lengths", 2, args, kwargs)
    tokens = ids.tokens if isinstance(ids, RolloutIds) else None
    if tokens is None or not isinstance(lengths, Sequence) or len(lengths) != len(tokens):
        return wrapped(*args, **kwargs)
    held_cost = step_held_cost(argument("args", 0, args, kwargs))
    counted = [SampleLength(length, index, tokens, held_cost) for index, length in enumerate(lengths)]
    if "total_lengths" in kwargs:
        kwargs = {**kwargs, "total_lengths": counted}
    else:
        args = (*args[:2], counted, *args[3:])
    return wrapped(*args, **kwargs)


def first_fit_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for `first_fit_pack(total_lengths, max_tokens_per_bin)` as slime's schedule
    calls it: lengths that know their samples' tokens packed by the tokens the model computes (each
    micro-batch's indices into `total_lengths`, in order); any other lengths as slime packs them."""
    lengths = argument("total_lengths", 0, args, kwargs)
    budget = argument("max_tokens_per_bin", 1, args, kwargs)
    if (not isinstance(lengths, Sequence) or not lengths
            or not all(isinstance(length, SampleLength) and length.tokens is not None for length in lengths)
            or not isinstance(budget, int) or budget < 1):
        return wrapped(*args, **kwargs)
    samples = [sample_ids(length.tokens[length.index], length.index) for length in lengths]
    held_cost = lengths[0].held_cost
    return physical_micro_batches(samples, budget) if held_cost is None else step_micro_batches(samples, budget,
                                                                                                held_cost=held_cost)
