"""The invariant mode across the ways a batch's rows are laid out (in the 2-rank gloo world the
tensor-parallel checks share: invariance_worlds.py): each sample alone (unpadded), packed back to
back (`thd`), padded to a common length (`bshd`), context parallelism at CP = 2 in both layouts
the package slices — zigzag and all-gather (`allgather_cp`, contiguous slices of the packed stream)
— and packed with the vocabulary split over the two ranks (TP = 2), through `ops.packing` (targets,
response pieces) and the public ops, fp32 and bf16. Every layout's response log-probs and
entropies are the unpadded bits. The negative control, the same on every CPU: both routes run the
invariant backend in every layout in the invariant mode and none of it in the default mode (counted),
so a route that dropped `invariant=` would fail here (the default mode's bits often move with the
layout, but whether they do is a matter of one CPU's BLAS and roundings)."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches import ops
from megatron_rl_patches.ops import packing
from megatron_rl_patches.testing.invariance import counting_invariant_calls

pytestmark = pytest.mark.multirank
TOTALS, RESPONSES = (150, 97, 211, 64), (60, 40, 130, 20)  # 522 rows: the fused head's default chunks show
H, V, CP = 128, 5000, 2
LAYOUTS = ("packed", "padded", "zigzag", "allgather", "packed_tp")


def _samples(dtype):
    """Per sample: its tokens, hidden rows [total, H] and logits rows [total, V]; the weight."""
    g = torch.Generator().manual_seed(11)
    weight = (torch.randn(V, H, generator=g) / H**0.5 * 3).to(dtype)
    tokens = [torch.randint(0, V, (n,), generator=g) for n in TOTALS]
    hidden = [torch.randn(n, H, generator=g).to(dtype) for n in TOTALS]
    logits = [(torch.randn(n, V, generator=g) * 3).to(dtype) for n in TOTALS]
    return tokens, hidden, logits, weight


def _pad(rows, length):
    return torch.cat([rows, rows.new_zeros(length - rows.size(0), *rows.shape[1:])])


def _local_rows(name, per_sample, rank):
    """This rank's rows of the batch in layout `name` (padding rows are zeros)."""
    if name in ("packed", "packed_tp"):
        return torch.cat(per_sample)
    if name == "padded":
        return torch.cat([_pad(rows, max(TOTALS)) for rows in per_sample])
    if name == "zigzag":  # each sample padded to 2·cp chunks; this rank holds chunks rank and 2·cp-1-rank
        local = []
        for rows in per_sample:
            chunk = -(-rows.size(0) // (2 * CP))
            chunks = _pad(rows, 2 * CP * chunk).split(chunk)
            local += [chunks[rank], chunks[2 * CP - 1 - rank]]
        return torch.cat(local)
    stream = torch.cat(per_sample)  # allgather: contiguous slices of the packed stream
    size = -(-stream.size(0) // CP)
    return _pad(stream, CP * size)[rank * size: (rank + 1) * size]


def _layout(name, rank):
    if name in ("packed", "padded", "packed_tp"):
        return packing.PackedLayout(TOTALS, RESPONSES, qkv_format="bshd" if name == "padded" else "thd",
                                    max_seq_len=max(TOTALS) if name == "padded" else None)
    return packing.PackedLayout(TOTALS, RESPONSES, cp_size=CP, cp_rank=rank, allgather_cp=name == "allgather")


def _responses(layout, tokens, hidden, logits, weight, invariant, tp_group=None):
    """Per route, per output, per sample: this rank's response rows, the rest zero (full length);
    and per route, its calls into the invariant backend. `tp_group`: the logits and weight are this
    rank's vocabulary shard."""
    n_rows = hidden.size(0)
    targets = packing.shifted_targets(tokens, layout, n_rows)
    with counting_invariant_calls() as fused_calls:
        fused = ops.lm_head_log_probs_and_entropy(hidden, weight, targets, with_entropy=True, invariant=invariant,
                                                  tp_group=tp_group)
    with counting_invariant_calls() as packing_calls:
        through_logits = packing.response_log_probs_and_entropy(logits.float(), tokens, layout, with_entropy=True,
                                                                invariant=invariant, tp_group=tp_group)
    calls = {"lm_head_log_probs_and_entropy": fused_calls.backend,
             "response_log_probs_and_entropy": packing_calls.backend}
    out = {}
    for j, name in enumerate(("log_prob", "entropy")):
        out["lm_head_log_probs_and_entropy", name] = _placed_split(packing.split_responses(fused[j], layout),
                                                                   layout, n_rows)
        out["response_log_probs_and_entropy", name] = _placed_split(through_logits[j], layout, n_rows)
    return out, calls


def _placed_split(per_sample, layout, n_rows):
    """`split_responses`' per-sample local rows put at their response offsets (zeros elsewhere)."""
    placed = []
    for i, (values, sample_pieces) in enumerate(zip(per_sample, packing.response_pieces(layout, n_rows))):
        full, at = torch.zeros(layout.response_lengths[i]), 0
        for piece in sample_pieces:
            width = piece.stop - piece.start
            full[piece.offset: piece.offset + width] = values[at: at + width]
            at += width
        placed.append(full)
    return torch.cat(placed)


def layout_checks(rank, world):
    """"values": per (layout, route, output, dtype, invariant) the responses, gathered over the CP
    ranks; "calls": per (layout, route, dtype, invariant) the calls into the invariant backend (of
    every sample alone: their sum)."""
    import torch.distributed as dist

    results, calls = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        tokens, hidden, logits, weight = _samples(dtype)
        for invariant in (True, False):
            alone: dict = {}
            for i in range(len(TOTALS)):  # every sample on its own, unpadded
                one = packing.PackedLayout((TOTALS[i],), (RESPONSES[i],))
                got, used = _responses(one, [tokens[i]], hidden[i], logits[i], weight, invariant)
                for key, value in got.items():
                    alone.setdefault(key, []).append(value)
                for route, count in used.items():
                    key = ("alone", route, str(dtype).removeprefix("torch."), invariant)
                    calls[key] = calls.get(key, 0) + count
            for key, parts in alone.items():
                results[("alone", *key, str(dtype).removeprefix("torch."), invariant)] = torch.cat(parts)
            for name in LAYOUTS:
                layout = _layout(name, rank)
                rows, shard, group = _local_rows(name, logits, rank), slice(None), None
                if name == "packed_tp":  # this rank's half of the vocabulary
                    shard, group = slice(rank * V // CP, (rank + 1) * V // CP), dist.group.WORLD
                got, used = _responses(layout, tokens, _local_rows(name, hidden, rank), rows[:, shard],
                                       weight[shard], invariant, group)
                for key, value in got.items():
                    if name in ("zigzag", "allgather"):  # each response row on one rank: the sum is that row
                        dist.all_reduce(value, group=dist.group.WORLD)
                    results[(name, *key, str(dtype).removeprefix("torch."), invariant)] = value
                for route, count in used.items():
                    calls[(name, route, str(dtype).removeprefix("torch."), invariant)] = count
    return {"values": results, "calls": calls}


@pytest.fixture(scope="module")
def results(invariance_world):
    return invariance_world.results(CP, "layouts")


def _differ(a, b):
    return float((a.double() - b.double()).abs().max()) if not torch.equal(a, b) else 0.0


def test_every_layout_gives_the_unpadded_bits_in_the_invariant_mode(results):
    for rank, rank_results in enumerate(result["values"] for result in results):
        assert len(rank_results) == (1 + len(LAYOUTS)) * 2 * 2 * 2 * 2  # layouts x routes x outputs x dtypes x modes
        wrong = {case: _differ(value, rank_results[("alone", *case[1:])]) for case, value in rank_results.items()
                 if case[-1] and not torch.equal(value, rank_results[("alone", *case[1:])])}
        assert not wrong, f"rank {rank}: invariant mode differs from the samples alone: {wrong}"


def test_every_layout_runs_the_invariant_code_in_the_invariant_mode_only(results):
    """The negative control: in every layout (the samples alone too), each route — the fused head
    and the packing route (`response_log_probs_and_entropy`, a logits op) — called the invariant
    backend in the invariant mode and never in the default mode, in both dtypes, on every rank; so an
    `invariant` a route dropped would show, whatever the CPU's bits."""
    for rank, result in enumerate(results):
        calls = result["calls"]
        assert len(calls) == (1 + len(LAYOUTS)) * 2 * 2 * 2  # layouts x routes x dtypes x modes
        wrong = {case: count for case, count in calls.items() if (count > 0) is not case[-1]}
        assert not wrong, f"rank {rank}: (layout, route, dtype, invariant): calls into the invariant backend {wrong}"
