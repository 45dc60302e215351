"""`counting_invariant_calls` (megatron_rl_patches.testing.invariance), the path observable the
negative controls of this folder rest on: it counts the invariant code an op runs, nothing in the
default mode, and leaves every method and binding as it found it — also after an error, nested,
and for a module imported inside the block."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from megatron_rl_patches import ops
from megatron_rl_patches.ops import row_blocks
from megatron_rl_patches.ops.kernels.invariant_tiles import InvariantTiles
from megatron_rl_patches.testing.invariance import counting_invariant_calls


def _logits():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 50, generator=g), torch.randint(0, 50, (6,), generator=g)


def test_the_invariant_mode_is_counted_and_the_default_mode_is_not():
    x, tokens = _logits()
    with counting_invariant_calls() as on:
        ops.log_probs_and_entropy(x, tokens, invariant=True)
    with counting_invariant_calls() as off:
        ops.log_probs_and_entropy(x, tokens, invariant=False)
    assert on.by_method["in_row_blocks"] == 1 and on.by_method["InvariantTiles.finalize"] == 1, on
    # the statistics too (the compiled sums' class or the tiles'): the backend's share
    assert on.row_blocks == 1 and on.backend >= 2 and on.count == on.backend + 1 and off.count == 0, (on, off)


def test_nested_blocks_both_count_and_everything_is_restored_after_an_error():
    x, tokens = _logits()
    finalize, blocks = InvariantTiles.__dict__["finalize"], row_blocks.in_row_blocks
    with pytest.raises(RuntimeError, match="inside"):
        with counting_invariant_calls() as outer:
            with counting_invariant_calls() as inner:
                ops.log_probs_and_entropy(x, tokens, invariant=True)
            ops.log_probs_and_entropy(x, tokens, invariant=True)
            raise RuntimeError("inside")
    assert inner.by_method["in_row_blocks"] == 1 and outer.by_method["in_row_blocks"] == 2, (inner, outer)
    assert InvariantTiles.__dict__["finalize"] is finalize and row_blocks.in_row_blocks is blocks
    bound = [name for name, module in list(sys.modules.items()) if name.startswith("megatron_rl_patches")
             and getattr(module, "in_row_blocks", blocks) is not blocks]
    assert not bound, bound


def test_a_module_imported_inside_the_block_is_counted_and_restored(monkeypatch):
    """A module first imported in the block binds the counting in_row_blocks (the package's ops
    load lazily); the block's end gives it the real one back."""
    late = types.ModuleType("megatron_rl_patches._late_probe")
    with counting_invariant_calls() as calls:
        late.in_row_blocks = row_blocks.in_row_blocks  # what `from ...row_blocks import in_row_blocks` binds now
        monkeypatch.setitem(sys.modules, late.__name__, late)
        late.in_row_blocks(lambda rows: rows * 2, 3, torch.ones(3))
    assert calls.by_method == {"in_row_blocks": 1}
    assert late.in_row_blocks is row_blocks.in_row_blocks
