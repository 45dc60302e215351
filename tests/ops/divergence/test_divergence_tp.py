"""lm_head_divergence under tensor parallelism (2 gloo ranks, one spawn for every case): each rank
holds a vocabulary shard of every model's output weight, with and without sequence parallelism,
one and two teachers, keep_mask and per-token temperature; values and gradients equal the dense
float64 route (grad_weight per shard, grad_hidden per sequence-parallel slice). The same spawn runs
the Megatron processors (hidden_output_processor gathering the teachers' sequence-parallel rows,
divergence_output_processor) on a sequence-parallel output layer."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megatron_rl_patches.testing import layouts

sys.path.insert(0, str(Path(__file__).parent))
from divergence_cases import (  # noqa: E402
    DIVERGENCES,
    TILE_BYTES,
    V_PADDED,
    T,
    assert_float64,
    make_inputs,
    ours,
    reference,
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


SEQ, BATCH = 6, 2  # T = 12 rows in (s, b) order


class _OutputLayer(torch.nn.Module):
    """What the processors read of a sequence-parallel ColumnParallelLinear output layer."""

    def __init__(self, weight, group):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self.tp_group, self.sequence_parallel = group, True


def _processor_case(rank, group):
    """jsd of two teachers through the processors, every hidden state sequence-parallel."""
    from divergence_cases import ALPHA, BETA, CHUNK_ROWS, VOCAB, mixture

    from megatron_rl_patches import divergence_output_processor, hidden_output_processor

    hidden, weight, teachers, _, tau, grad_out = _shard(rank, make_inputs(2), True)
    states = [hidden_output_processor()(hidden_states=th.reshape(SEQ // WORLD, BATCH, -1),
                                        output_layer=_OutputLayer(tw, group)) for th, tw in teachers]
    assert states[0].shape == (BATCH, SEQ, teachers[0][0].size(1))
    layer = _OutputLayer(weight.clone(), group)
    local = hidden.clone().reshape(SEQ // WORLD, BATCH, -1).requires_grad_()
    process = divergence_output_processor(divergence="jsd", beta=BETA, alpha=ALPHA, teacher_weights=mixture(2),
                                          temperature=tau, vocab_size=VOCAB, chunk_size=CHUNK_ROWS)
    out = process(hidden_states=local, output_layer=layer,
                  context={"teacher_hidden": states, "teacher_weight": [tw for _, tw in teachers]})
    value = out.transpose(0, 1).reshape(-1)  # [b, s] -> (s, b) rows
    (value * grad_out).sum().backward()
    return value.detach(), local.grad.reshape(-1, local.size(-1)), layer.weight.grad


def _all_cases(rank, world_size):
    import torch.distributed as dist

    from megatron_rl_patches.ops.kernels import torch_tiles

    torch_tiles.CPU_TILE_BYTES = TILE_BYTES  # several vocabulary tiles per shard
    results = []
    for divergence, n, sp, keep, per_token in CASES:
        local = _shard(rank, make_inputs(n, keep=keep, per_token_tau=per_token), sp)
        results.append(ours(divergence, *local, tp_group=dist.group.WORLD, sequence_parallel=sp))
    results.append(_processor_case(rank, dist.group.WORLD))
    return results


@layouts.mark("tp2", "sp")
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
    value, grad_h, grad_w, lse = reference("jsd", *make_inputs(2))
    for rank, outs in enumerate(results):
        want = (value, grad_h[rank * per : (rank + 1) * per], grad_w[rank * rows : (rank + 1) * rows], lse)
        assert_float64(outs[-1], want, ("processors", rank))
