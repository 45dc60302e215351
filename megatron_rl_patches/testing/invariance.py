"""Check that a per-row computation is batch-invariant: the same rows computed alone and amid
other rows (before, after, around them) give the same bits (docs/train-rollout-agreement.md).

    from megatron_rl_patches.testing.invariance import check_rows_invariant

    report = check_rows_invariant(
        lambda h, t: ops.lm_head_log_probs_and_entropy(h, weight, t, invariant=True)[0],
        (hidden, tokens), others=(other_hidden, other_tokens))
    assert report.identical, report
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["InvarianceReport", "check_rows_invariant", "surround"]

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
