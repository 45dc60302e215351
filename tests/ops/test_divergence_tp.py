"""lm_head_divergence under tensor parallelism (2 gloo ranks, one spawn for every case): each rank
holds a vocabulary shard of every model's output weight, with and without sequence parallelism,
one and two teachers, keep_mask and per-token temperature; values and gradients equal the dense
float64 route (grad_weight per shard, grad_hidden per sequence-parallel slice)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from divergence_cases import (  # noqa: E402
    DIVERGENCES, T, TILE_BYTES, V_PADDED, assert_float64, make_inputs, ours, reference,
)
from megatron_rl_patches.testing.multirank import run_multirank  # noqa: E402

pytestmark = pytest.mark.multirank
WORLD = 2
# (divergence, teachers, sequence parallel, keep_mask, per-token temperature)
CASES = [(d, n, sp, n == 2 and not sp, sp) for d in DIVERGENCES for n in (1, 2) for sp in (False, True)]


def _shard(rank, inputs, sp):
    hidden, weight, teachers, keep_mask, tau, grad_out = inputs
    rows, per = V_PADDED // WORLD, T // WORLD
    cols = slice(rank * rows, (rank + 1) * rows)
    if sp:
        hidden = hidden[rank * per : (rank + 1) * per]
        teachers = [(th[rank * per : (rank + 1) * per], tw[cols]) for th, tw in teachers]
    else:
        teachers = [(th, tw[cols]) for th, tw in teachers]
    keep_mask = keep_mask[:, cols] if keep_mask is not None else None
    return hidden, weight[cols], teachers, keep_mask, tau, grad_out


def _all_cases(rank, world_size):
    import torch.distributed as dist

    from megatron_rl_patches.ops.kernels import torch_tiles

    torch_tiles.CPU_TILE_BYTES = TILE_BYTES  # several vocabulary tiles per shard
    results = []
    for divergence, n, sp, keep, per_token in CASES:
        local = _shard(rank, make_inputs(n, keep=keep, per_token_tau=per_token), sp)
        results.append(ours(divergence, *local, tp_group=dist.group.WORLD, sequence_parallel=sp))
    return results


def test_tp2_matches_dense_float64():
    results = run_multirank(_all_cases, WORLD, timeout=300)
    rows, per = V_PADDED // WORLD, T // WORLD
    for i, (divergence, n, sp, keep, per_token) in enumerate(CASES):
        value, grad_h, grad_w, lse = reference(divergence, *make_inputs(n, keep=keep, per_token_tau=per_token))
        for rank, outs in enumerate(results):
            got_value, got_h, got_w = outs[i]
            want_h = grad_h[rank * per : (rank + 1) * per] if sp else grad_h
            want_w = grad_w[rank * rows : (rank + 1) * rows]
            assert_float64((got_value, got_h, got_w), (value, want_h, want_w, lse),
                           (divergence, n, "sp" if sp else "tp", rank))
