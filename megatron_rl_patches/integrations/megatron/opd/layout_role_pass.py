"""slime's log-prob pass of a role built at its own layout (`role;tp=N`, layout_role): slime's
`forward_only(get_log_probs_and_entropy, args, model, data_iterator, num_microbatches,
store_prefix)` runs Megatron's schedule and slime's loss code in the student's process groups,
which the role's model does not live in; for a model whose chunk carries `teacher_groups` the
`inference_roles` wrapper of forward_only serves the pass instead through score_at_layout.

Each rank takes its own micro-batches from slime's data iterator (right-padded to the longest
sample: attention is causal, padding never changes a real row); the ranks of a teacher
tensor-parallel group agree on how many micro-batches they run (a rank with fewer runs empty
ones, never leaving the others waiting), and each rank gets slime's per-sample results on its
response rows (the logits row before each response token: rows total - R - 1 .. total - 2), keyed
`store_prefix + "log_probs"` (and `"entropy"` with slime's --use-rollout-entropy), in slime's
order (--use-dynamic-batch-size: back to the rollout's)."""
from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from megatron_rl_patches.integrations.megatron.opd.layout_role import where
from megatron_rl_patches.integrations.step_mode import student_invariant
from megatron_rl_patches.model.arguments import bind

if TYPE_CHECKING:  # torch is imported where a pass runs: the patch's records import this module cheaply
    import torch

SERVED = "get_log_probs_and_entropy"
KEYS = ("tokens", "total_lengths", "response_lengths")


def at_layout(model: Any) -> bool:
    """Whether slime's `model` (its chunk list) was built at a layout of its own."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return bool(chunks) and getattr(chunks[0], "teacher_groups", None) is not None


def forward_only_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of slime's forward_only: a model at its own layout is scored here; any other
    goes to slime (with the fused route's wrapper, when applied, around both)."""
    bound = bind(wrapped, args, kwargs)
    if bound is None or not at_layout(bound.arguments.get("model")):
        return wrapped(*args, **kwargs)
    return layout_pass(bound.arguments)


def _refuse_unserved(arguments: dict[str, Any], entry: str) -> None:
    f = arguments["f"]
    name = getattr(f, "__name__", type(f).__name__)
    if name != SERVED:
        raise ValueError(f"{entry}: slime's forward_only with {name}: a role at its own layout serves slime's "
                         f"log-prob pass ({SERVED}) only; drop ';tp='")
    if arguments.get("use_rollout_top_p_replay"):
        raise ValueError(f"{entry}: slime's rollout top-p replay (the rollout's kept ids) is not served for a role "
                         "at its own layout yet: drop ';tp=' or the replay")


def _agreed_count(count: int, groups: Any) -> int:
    """The largest micro-batch count of the teacher tensor-parallel group."""
    # lazy: import cost: torch (the patch records import this module without it)
    from megatron_rl_patches.ops import agreement

    return agreement.agreed_max(groups.tp_group, count)


def _padded(samples: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, longest] tokens right-padded with 0, and their labels (the next token; 0 at the end)."""
    import torch  # lazy: import cost: the patch records import this module without torch

    longest = max((int(s.shape[0]) for s in samples), default=0)
    tokens = torch.zeros(len(samples), longest, dtype=torch.int64)
    for row, sample in enumerate(samples):
        tokens[row, : sample.shape[0]] = sample.detach().cpu().to(torch.int64)
    labels = torch.zeros_like(tokens)
    labels[:, :-1] = tokens[:, 1:]
    return tokens, labels


def _score_micro_batch(model: list[Any], batch: dict[str, Any], temperature: float,
                       with_entropy: bool, invariant: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sample of the micro-batch, the role's log-probs (and entropy) on its response rows."""
    # lazy: import cost: torch (the patch records import this module without it)
    from megatron_rl_patches.inference.teacher_layout.scoring import score_with_entropy_at_layout

    samples = list(batch.get("tokens") or [])
    tokens, labels = _padded(samples)
    log_probs, entropy = score_with_entropy_at_layout(model, tokens, labels, temperature=temperature,
                                                      with_entropy=with_entropy, invariant=invariant)
    totals = [int(t) for t in batch["total_lengths"]] if samples else []
    responses = [int(r) for r in batch["response_lengths"]] if samples else []
    spans = [slice(total - response - 1, total - 1) for total, response in zip(totals, responses)]
    return ([log_probs[i, span] for i, span in enumerate(spans)],
            [entropy[i, span] for i, span in enumerate(spans)] if entropy is not None else [])


def _run_before_hook(run_args: Any, model: Any, prefix: str) -> None:
    """The args' `custom_megatron_before_log_prob_hook_path` (slime's flag: "module.function",
    resolved as slime's `load_function` does), called as slime's forward_only does."""
    path = getattr(run_args, "custom_megatron_before_log_prob_hook_path", None)
    if path:
        module, _, name = path.rpartition(".")
        getattr(importlib.import_module(module), name)(run_args, model, prefix)


def layout_pass(arguments: dict[str, Any]) -> dict[str, list[torch.Tensor]]:
    """slime's forward_only result for a model at its own layout (every rank of the world calls it)."""
    model, run_args = list(arguments["model"]), arguments["args"]
    groups = model[0].teacher_groups
    entry = where(getattr(model[0], "role", "?"), groups.tp_size)
    _refuse_unserved(arguments, entry)
    prefix = arguments.get("store_prefix") or ""
    iterators = arguments["data_iterator"]
    for iterator in iterators:
        iterator.reset()
    _run_before_hook(run_args, model, prefix)
    count = sum(int(n) for n in arguments["num_microbatches"])
    batches = [iterators[0].get_next(list(KEYS)) for _ in range(count)]
    # lazy: import cost: torch (the patch records import this module without it)
    from megatron_rl_patches.inference.residency.placement import forward_device

    device = forward_device(model)  # a swap / stream role's parameters read host copies between forwards
    temperature = float(getattr(run_args, "rollout_temperature", 1.0) or 1.0)
    with_entropy = bool(getattr(run_args, "use_rollout_entropy", False))
    invariant = student_invariant(model)  # the mode of the step handed this model, resolved once
    log_probs: list[torch.Tensor] = []
    entropies: list[torch.Tensor] = []
    for index in range(_agreed_count(count, groups)):
        batch = batches[index] if index < count else {}  # this rank has no more: it takes part empty
        mine, entropy = _score_micro_batch(model, batch, temperature, with_entropy, invariant)
        log_probs += [value.to(device) for value in mine]
        entropies += [value.to(device) for value in entropy]
    result = {"log_probs": log_probs, **({"entropy": entropies} if with_entropy else {})}
    if getattr(run_args, "use_dynamic_batch_size", False):  # slime's reorder: back to the rollout's order
        order: list[int] = sum(iterators[0].micro_batch_indices, [])
        for key, values in result.items():
            ordered: list[Any] = [None] * len(values)
            for value, index in zip(values, order):
                ordered[index] = value
            result[key] = ordered
    return {f"{prefix}{key}": values for key, values in result.items()}
