"""Packed / CP-zigzag / allgather-CP response slices against a per-sample reference."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_rl_patches.ops.packing import (
    PackedLayout,
    allgather_cp_to_zigzag,
    response_log_probs_and_entropy,
    response_pieces,
    shifted_targets,
    split_responses,
    zigzag_to_allgather_cp,
)
from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.multirank import run_multirank

V = 11
TOTALS = (9, 5, 14, 2)
RESPONSES = (4, 1, 13, 0)


def samples(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = [torch.randn(n, V, generator=g) * 2 for n in TOTALS]
    tokens = [torch.randint(0, V, (n,), generator=g) for n in TOTALS]
    return logits, tokens


def per_sample_reference(logits, tokens):
    """Response log-probs and entropies of each sample on its own, float64."""
    out_lp, out_ent = [], []
    for x, tok, total, resp in zip(logits, tokens, TOTALS, RESPONSES):
        rows = x.double()[total - resp - 1 : total - 1]
        logp = torch.log_softmax(rows, -1)
        out_lp.append(logp.gather(1, tok[total - resp :, None]).squeeze(1))
        out_ent.append(-(logp.exp() * logp).sum(-1))
    return out_lp, out_ent


def pad_rows(x, n):
    return torch.cat([x, torch.full((n - x.size(0), *x.shape[1:]), 7.0)]) if x.size(0) < n else x


def local_rows(logits, layout: PackedLayout, global_rows: int | None = None):
    """Build this rank's logits rows the way Megatron lays them out."""
    if layout.allgather_cp and layout.cp_size > 1:
        packed = torch.cat(logits)
        per_rank = -(-packed.size(0) // layout.cp_size)
        packed = pad_rows(packed, per_rank * layout.cp_size)
        return packed[layout.cp_rank * per_rank : (layout.cp_rank + 1) * per_rank]
    parts = []
    for x, total in zip(logits, TOTALS):
        if layout.zigzag:
            chunk = layout.zigzag_chunk(total)
            x = pad_rows(x, 2 * layout.cp_size * chunk)
            for k in (layout.cp_rank, 2 * layout.cp_size - 1 - layout.cp_rank):
                parts.append(x[k * chunk : (k + 1) * chunk])
        else:
            parts.append(pad_rows(x, layout.sample_rows(total)))
    return torch.cat(parts)


LAYOUTS = {
    "thd": dict(),
    "bshd": dict(qkv_format="bshd", max_seq_len=16),
    "zigzag-cp2": dict(cp_size=2),
    "zigzag-cp3": dict(cp_size=3),
    "zigzag-cp2-bshd": dict(cp_size=2, qkv_format="bshd", max_seq_len=16),
    "allgather-cp2": dict(cp_size=2, allgather_cp=True),
    "allgather-cp3": dict(cp_size=3, allgather_cp=True),
}


# docs/layouts.md: the layouts' marker names
MARKS = {"thd": ("thd",), "bshd": ("bshd",), "zigzag-cp2": ("cp2-zigzag", "thd"),
         "allgather-cp2": ("cp2-allgather", "thd"), "zigzag-cp2-bshd": ("cp2-zigzag", "bshd")}


@pytest.mark.parametrize("name", [pytest.param(name, marks=[layouts.mark(*MARKS[name])] if name in MARKS else [])
                                  for name in LAYOUTS])
def test_slices_match_per_sample_reference_on_every_rank(name):
    logits, tokens = samples()
    ref_lp, ref_ent = per_sample_reference(logits, tokens)
    cfg = LAYOUTS[name]
    covered = [torch.zeros(r, dtype=torch.int) for r in RESPONSES]
    for rank in range(cfg.get("cp_size", 1)):
        layout = PackedLayout(TOTALS, RESPONSES, cp_rank=rank, **cfg)
        rows = local_rows(logits, layout)
        x = rows.clone().requires_grad_()
        lps, ents = response_log_probs_and_entropy(x, tokens, layout, with_entropy=True)
        assert len(lps) == len(TOTALS)
        sum(lp.sum() for lp in lps).backward()
        pieces = response_pieces(layout, rows.size(0))
        grad_rows = torch.zeros(rows.size(0), dtype=torch.bool)
        for i, (lp, ent, sample_pieces) in enumerate(zip(lps, ents, pieces)):
            positions = torch.cat([torch.arange(p.offset, p.offset + p.stop - p.start) for p in sample_pieces]
                                  ) if sample_pieces else torch.zeros(0, dtype=torch.long)
            assert lp.shape == positions.shape
            torch.testing.assert_close(lp.double(), ref_lp[i][positions], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(ent.double(), ref_ent[i][positions], rtol=0, atol=1e-5)
            covered[i][positions] += 1
            for p in sample_pieces:
                grad_rows[p.start : p.stop] = True
        # one computation over the full tensor: only response rows receive gradient
        assert torch.all(x.grad[~grad_rows] == 0) and torch.all(x.grad[grad_rows].abs().sum(1) > 0)
    for i, c in enumerate(covered):  # the ranks together cover every response token exactly once
        assert torch.all(c == 1), f"sample {i}: coverage {c.tolist()}"


def test_shifted_targets_are_the_next_tokens():
    logits, tokens = samples(1)
    layout = PackedLayout(TOTALS, RESPONSES)
    targets = shifted_targets(tokens, layout, sum(TOTALS) + 3)
    start = 0
    for tok, total in zip(tokens, TOTALS):
        assert torch.equal(targets[start : start + total - 1], tok[1:])
        start += total
    assert torch.all(targets[-3:] == 0)


def test_split_responses_keeps_trailing_dims_and_views():
    layout = PackedLayout(TOTALS, RESPONSES)
    values = torch.arange(sum(TOTALS) * 2.0).reshape(-1, 2)
    parts = split_responses(values, layout)
    assert [p.shape for p in parts] == [(r, 2) for r in RESPONSES]
    assert parts[0].data_ptr() == values[TOTALS[0] - RESPONSES[0] - 1].data_ptr()  # a view, no copy


def test_layout_errors():
    with pytest.raises(ValueError, match="allgather-CP.*thd"):
        PackedLayout(TOTALS, RESPONSES, cp_size=2, allgather_cp=True, qkv_format="bshd", max_seq_len=16)
    with pytest.raises(ValueError, match="response_length"):
        PackedLayout((4,), (4,))
    with pytest.raises(ValueError, match="same samples"):
        PackedLayout((4, 5), (1,))
    with pytest.raises(ValueError, match="max_seq_len"):
        PackedLayout(TOTALS, RESPONSES, qkv_format="bshd", max_seq_len=10)
    with pytest.raises(ValueError, match="cp_rank"):
        PackedLayout(TOTALS, RESPONSES, cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="rows"):
        response_pieces(PackedLayout(TOTALS, RESPONSES), 10)
    with pytest.raises(ValueError, match="total_length"):
        shifted_targets([torch.zeros(3, dtype=torch.long)] * 4, PackedLayout(TOTALS, RESPONSES), 40)


def _redistribute_worker(rank: int, world_size: int) -> dict:
    """allgather-CP values -> zigzag pieces; values, requires_grad and gradients by rank."""
    group = dist.new_group(list(range(world_size)))
    ag = PackedLayout(TOTALS, RESPONSES, cp_size=world_size, cp_rank=rank, allgather_cp=True)
    zig = PackedLayout(TOTALS, RESPONSES, cp_size=world_size, cp_rank=rank)
    num_rows = -(-sum(TOTALS) // world_size)
    g = torch.Generator().manual_seed(3)
    full = [torch.randn(r, 3, generator=g) for r in RESPONSES]  # per-sample response values, trailing dim
    weights = [torch.randn(r, 3, generator=g) for r in RESPONSES]

    def take(tensors, layout, rows):
        return [torch.cat([t[p.offset : p.offset + p.stop - p.start] for p in pieces]) if pieces else t[:0]
                for t, pieces in zip(tensors, response_pieces(layout, rows))]

    zig_rows = sum(zig.sample_rows(t) for t in TOTALS)
    expected = take(full, zig, zig_rows)
    result = {}
    # metrics: no grad in, no grad out, plain collective
    metric = allgather_cp_to_zigzag(take(full, ag, num_rows), ag, num_rows, group)
    result["metric_requires_grad"] = any(t.requires_grad for t in metric)
    result["metric_ok"] = all(torch.equal(a, b) for a, b in zip(metric, expected))
    # loss inputs: differentiable; d(sum over ranks of w·out)/d(in) = w at the same response position
    leaves = [t.clone().requires_grad_() for t in take(full, ag, num_rows)]
    out = allgather_cp_to_zigzag(leaves, ag, num_rows, group)
    result["loss_requires_grad"] = all(t.requires_grad for t in out)
    result["loss_ok"] = all(torch.equal(a.detach(), b) for a, b in zip(out, expected))
    sum((o * w).sum() for o, w in zip(out, take(weights, zig, zig_rows))).backward()
    result["grad_ok"] = all(
        torch.allclose(leaf.grad, w) for leaf, w in zip(leaves, take(weights, ag, num_rows))
    )
    # masks and ids: bool moves as integers and comes back bool; the inverse move restores each rank's pieces
    masks = [t > 0 for t in full]
    for name, values in (("masks", masks), ("ids", [(t * 100).long() for t in full])):
        moved = allgather_cp_to_zigzag(take(values, ag, num_rows), ag, num_rows, group)
        back = zigzag_to_allgather_cp(moved, ag, num_rows, group)
        want = take(values, zig, zig_rows) + take(values, ag, num_rows)
        result[f"{name}_ok"] = all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(moved + back, want))
    empty = PackedLayout((), (), cp_size=world_size, cp_rank=rank, allgather_cp=True)
    result["no_samples"] = allgather_cp_to_zigzag([], empty, 0, group)
    return result


@layouts.mark("cp2-zigzag", "cp2-allgather")
@pytest.mark.multirank
def test_allgather_cp_to_zigzag_on_two_ranks():
    for rank, result in enumerate(run_multirank(_redistribute_worker, 2)):
        assert result == {"metric_requires_grad": False, "metric_ok": True, "loss_requires_grad": True,
                          "loss_ok": True, "grad_ok": True, "masks_ok": True, "ids_ok": True,
                          "no_samples": []}, f"rank {rank}: {result}"
