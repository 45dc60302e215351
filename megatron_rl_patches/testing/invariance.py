"""Check that a per-row computation is batch-invariant: the same rows computed alone and amid
other rows (before, after, around them) give the same bits (docs/train-rollout-agreement.md).

    from megatron_rl_patches.testing.invariance import check_rows_invariant

    report = check_rows_invariant(
        lambda h, t: ops.lm_head_log_probs_and_entropy(h, weight, t, invariant=True)[0],
        (hidden, tokens), others=(other_hidden, other_tokens))
    assert report.identical, report

Which path an op ran, the same on every CPU (its two modes' bits may coincide on one CPU's
kernels, so a bit difference proves nothing there):

    from megatron_rl_patches.testing.invariance import counting_invariant_calls

    with counting_invariant_calls() as calls:
        ops.topk_logprobs(logits, ids, invariant=True)
    assert calls.count > 0, calls
"""
from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_rl_patches.ops import row_blocks
from megatron_rl_patches.ops.kernels.invariant_tiles import InvariantTiles

__all__ = ["InvarianceReport", "InvariantCalls", "check_rows_invariant", "counting_invariant_calls", "surround"]

Outputs = torch.Tensor | Sequence[torch.Tensor]


@dataclass
class InvarianceReport:
    """Per placement ("before", "after", "around"): the largest |difference| from the rows computed
    alone over every output; `identical` when every placement gave the same bits."""

    max_abs_diff: dict[str, float] = field(default_factory=dict)

    @property
    def identical(self) -> bool:
        return all(diff == 0.0 for diff in self.max_abs_diff.values())


def surround(rows: Sequence[torch.Tensor], others: Sequence[torch.Tensor], split: int) -> tuple[list[torch.Tensor],
                                                                                                slice]:
    """Each of `rows` with `others`' first `split` rows before it and the rest after; and where the
    rows sit in the result."""
    count = rows[0].size(0)
    placed = [torch.cat([o[:split], r, o[split:]]) for r, o in zip(rows, others)]
    return placed, slice(split, split + count)


def _as_list(outputs: Outputs) -> list[torch.Tensor]:
    return [outputs] if isinstance(outputs, torch.Tensor) else [o for o in outputs if o is not None]


def check_rows_invariant(fn: Callable[..., Outputs], rows: Sequence[torch.Tensor], others: Sequence[torch.Tensor],
                         ) -> InvarianceReport:
    """``fn(*rows)`` against ``fn(*placed)`` with `others`' rows (the same count of tensors, the
    same trailing shapes) placed before, after and around them; outputs have the rows first."""
    if len(rows) != len(others):
        raise ValueError(f"rows and others must hold the same tensors, got {len(rows)} and {len(others)}")
    with torch.no_grad():
        alone = _as_list(fn(*rows))
        n_others = others[0].size(0)
        report = InvarianceReport()
        for name, split in (("after", 0), ("before", n_others), ("around", n_others // 2)):
            placed, where = surround(rows, others, split)
            diff = 0.0
            for a, b in zip(alone, _as_list(fn(*placed))):
                b = b[where]
                if not torch.equal(a, b):
                    diff = max(diff, float((a.double() - b.double()).abs().nan_to_num(float("inf")).max()))
                    diff = diff or float("inf")  # NaN in different places, or equal values with other bits
            report.max_abs_diff[name] = diff
    return report


# The forward entry points of a backend (the contract of megatron_rl_patches.ops.kernels): the
# statistics, their finalize step, the top-k ids and a tie's tiles
FORWARD_METHODS = ("row_stats", "combined_stats", "finalize", "topk", "tie_tiles")
ROW_BLOCKS = "in_row_blocks"


@dataclass
class InvariantCalls:
    """Calls into the invariant mode's code while :func:`counting_invariant_calls` was open: the
    invariant backends' forward methods by ``Class.method``, and the fixed row blocks
    (``in_row_blocks``); a call that makes another counts both."""

    by_method: Counter[str] = field(default_factory=Counter)

    @property
    def count(self) -> int:
        return sum(self.by_method.values())

    @property
    def backend(self) -> int:
        """The calls into the invariant backends (statistics, finalize, top-k ids)."""
        return self.count - self.row_blocks

    @property
    def row_blocks(self) -> int:
        return self.by_method[ROW_BLOCKS]


def _invariant_classes() -> list[type[InvariantTiles]]:
    """InvariantTiles and every subclass imported so far (compiled CPU sums; Triton's kernel)."""
    found: list[type[InvariantTiles]] = []
    pending: list[type[InvariantTiles]] = [InvariantTiles]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return found


def _counted(calls: InvariantCalls, key: str, function: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        calls.by_method[key] += 1
        return function(*args, **kwargs)

    return call


@contextmanager
def counting_invariant_calls() -> Iterator[InvariantCalls]:
    """Count, while the block runs, the calls into the invariant mode's code: the forward methods
    of the invariant tiles backend
    (:class:`~megatron_rl_patches.ops.kernels.invariant_tiles.InvariantTiles`) and its subclasses
    (the compiled CPU sums; Triton's kernel), and ``row_blocks.in_row_blocks``, the fixed row
    blocks every invariant finalize runs in (also the kept-set head's and ``topk_kl``'s, which
    use no backend). An op resolved to the invariant mode calls them, one in the default mode
    never does, on every CPU: the path an op took, where its two modes' bits may coincide. A
    subclass imported inside the block is counted through what it inherits (finalize, topk).
    Not thread-safe: the methods and every module's binding of in_row_blocks (also of a module
    imported inside the block) are replaced until the block ends."""
    calls = InvariantCalls()
    replaced: list[tuple[type, str, Any]] = []
    blocks = row_blocks.in_row_blocks
    counted_blocks = _counted(calls, ROW_BLOCKS, blocks)
    try:
        for cls in _invariant_classes():
            for name in FORWARD_METHODS:
                if callable(cls.__dict__.get(name)):
                    replaced.append((cls, name, cls.__dict__[name]))
                    setattr(cls, name, _counted(calls, f"{cls.__name__}.{name}", cls.__dict__[name]))
        for module in _package_modules():  # row_blocks' own too: a module imported in the block binds the count
            if getattr(module, ROW_BLOCKS, None) is blocks:
                setattr(module, ROW_BLOCKS, counted_blocks)
        yield calls
    finally:
        for owner, name, value in reversed(replaced):
            setattr(owner, name, value)
        for module in _package_modules():
            if getattr(module, ROW_BLOCKS, None) is counted_blocks:
                setattr(module, ROW_BLOCKS, blocks)


def _package_modules() -> list[Any]:
    return [module for name, module in list(sys.modules.items()) if name.split(".")[0] == "megatron_rl_patches"]
