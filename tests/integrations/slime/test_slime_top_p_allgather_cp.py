"""slime_fused's top-p replay under `--allgather-cp` on 2 gloo context-parallel ranks (real
megatron-core, the kit's CPU context-parallel attention in the contiguous layout): each rank maps
the rollout's nuclei onto the response rows of its contiguous slice of the packed stream
(`kept_context(..., allgather_cp=True)`), and the fused log-prob processor's kept-set log-probs on
those rows, with every parameter's gradient summed over the ranks, equal the CP=1 model's on the
whole stream. slime's `_extract_per_sample` (not in the main suite) is stood in for by its rows:
a sample's response logits rows of the stream, cut to the rank's slice (the slime lane runs
slime's own). Negative control: the kept sets of a rank's rows in reverse token order differ."""
from __future__ import annotations

import pytest

from megatron_rl_patches.testing import layouts

pytestmark = [pytest.mark.megatron, pytest.mark.multirank]

CP = 2
TOTALS, RESPONSES = (10, 6, 8), (5, 4, 6)  # 24 rows, 12 per rank: sample 1's response spans both
COVERED = (5, 4, 4)  # the tokens with a recorded nucleus: sample 2's last two keep the full vocabulary
REL = 1e-5  # fp32 rounding against the CP=1 model


def _stream_rows(batch: dict, length: int, device, allgather_cp: bool) -> list:
    """slime's per-sample response rows (624b824a `_extract_per_sample`, CP=1 or allgather-CP): the
    logits rows [first, first + R) of the stream, cut to this rank's contiguous slice."""
    import torch
    from megatron.core import parallel_state

    chunk_start = parallel_state.get_context_parallel_rank() * length if allgather_cp else 0
    pieces, seq_start = [], 0
    for total, response in zip(batch["total_lengths"], batch["response_lengths"]):
        first = seq_start + total - response - 1
        lo, hi = max(first, chunk_start), min(first + response, chunk_start + length)
        pieces.append(torch.arange(lo, max(lo, hi), device=device) - chunk_start)
        seq_start += total
    return pieces


def _nuclei(vocab: int) -> dict:
    """Per sample, slime's flat kept ids and offsets: 0 to 4 ids per covered token (strict subsets)."""
    import torch

    gen = torch.Generator().manual_seed(11)
    ids, offsets = [], []
    for covered in COVERED:
        counts = torch.randint(0, 5, (covered,), generator=gen)
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]))
        ids.append(torch.randint(0, vocab, (int(counts.sum()),), generator=gen, dtype=torch.int64).to(torch.int32))
    return {"rollout_top_p_token_ids": ids, "rollout_top_p_token_offsets": offsets,
            "total_lengths": list(TOTALS), "response_lengths": list(RESPONSES)}


def _gap(got: list, want: list) -> float:
    return max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True) if w.numel())


def _scored(model, batch: dict, meta: dict, allgather_cp: bool, weights: list) -> tuple:
    """Per sample, the kept-set (and plain) log-probs on this rank's response rows; the gradients of
    sum(weights · kept log-probs), summed over the context-parallel ranks with `allgather_cp`."""
    import torch
    import torch.distributed as dist

    from megatron_rl_patches import log_prob_output_processor
    from megatron_rl_patches.integrations.slime.rows import response_positions
    from megatron_rl_patches.integrations.slime.top_p import kept_context

    length = batch["tokens"].size(1)
    rows = response_positions(meta, length, "cpu", allgather_cp)
    row_mask = torch.zeros(1, length, dtype=torch.bool)
    row_mask[0, torch.cat(rows)] = True
    context = {"row_mask": row_mask, **kept_context(meta, length, "cpu", allgather_cp)}
    out = model(batch["tokens"], batch["position_ids"], None, packed_seq_params=batch["packed_seq_params"],
                labels=batch["labels"], output_processor=log_prob_output_processor(),
                output_processor_context=context)
    kept = [out["kept_log_probs"][0, r] for r in rows]
    sum((w * k).sum() for w, k in zip(weights, kept)).backward()
    grads = {}
    for name, param in model.named_parameters():
        grads[name] = param.grad.clone()
        if allgather_cp:
            dist.all_reduce(grads[name])
    model.zero_grad()
    return [k.detach() for k in kept], [out["log_probs"][0, r].detach() for r in rows], grads


def _world(rank: int, world_size: int) -> dict:
    import types

    import torch

    import megatron_rl_patches
    from megatron_rl_patches.integrations.slime import rows as slime_rows
    from megatron_rl_patches.integrations.slime import top_p
    from megatron_rl_patches.testing.cp_attention import cp_layer_spec
    from megatron_rl_patches.testing.cp_layout import split_batch
    from megatron_rl_patches.testing.megatron_cpu import TINY_VOCAB, megatron_on_cpu
    from megatron_rl_patches.testing.packed_gpt import make_packed_batch, packed_gpt_spec

    megatron_rl_patches.apply(only="gpt_output_processor")  # `native` on >= 0.18
    slime_rows.response_positions = _stream_rows
    slime_rows.slime_loss = lambda: types.SimpleNamespace(slice_log_prob_with_cp=lambda values, total, response: values)
    batch, meta = make_packed_batch(list(TOTALS), seed=5), _nuclei(TINY_VOCAB)
    cu = batch["packed_seq_params"].cu_seqlens_q
    weights = [torch.randn(r, generator=torch.Generator().manual_seed(3 + i)) for i, r in enumerate(RESPONSES)]
    with megatron_on_cpu() as env:
        model = env.gpt(env.config(), layer_spec=packed_gpt_spec(), seed=3, seq_length=32)
        ref_kept, ref_plain, ref_grads = _scored(model, batch, meta, False, weights)
    with megatron_on_cpu(context_parallel=world_size) as env:
        model = env.gpt(env.config(context_parallel_size=world_size), layer_spec=cp_layer_spec("contiguous"), seed=3,
                        seq_length=32)
        local = split_batch(batch, "contiguous", rank, world_size, cu)
        chunk_start = rank * local["tokens"].size(1)
        spans = [(int(r[0]) + chunk_start - int(f[0]), int(r[0]) + chunk_start - int(f[0]) + r.numel())
                 if r.numel() else (0, 0)  # the response tokens of this rank's rows, per sample
                 for r, f in zip(_stream_rows(meta, local["tokens"].size(1), "cpu", True),
                                 _stream_rows(meta, sum(TOTALS), "cpu", False))]
        local_weights = [w[a:b] for w, (a, b) in zip(weights, spans)]
        kept, _, grads = _scored(model, local, meta, True, local_weights)
        forward = top_p.local_response_tokens
        top_p.local_response_tokens = lambda *args: [t.flip(0) for t in forward(*args)]  # a wrong row mapping
        try:
            wrong, _, _ = _scored(model, local, meta, True, local_weights)
        finally:
            top_p.local_response_tokens = forward
    want = [k[a:b] for k, (a, b) in zip(ref_kept, spans)]
    return {
        "held": [b - a for a, b in spans],
        "kept": _gap(kept, want),
        "grads": max(float((grads[n] - ref_grads[n]).abs().max()) / max(1.0, float(ref_grads[n].abs().max()))
                     for n in ref_grads),
        "same_names": sorted(grads) == sorted(ref_grads),
        "wrong": _gap(wrong, want),
        "renormalized": _gap(ref_kept, ref_plain),
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    from megatron_rl_patches.testing.multirank import run_multirank

    return run_multirank(_world, CP, timeout=120)


@layouts.mark("cp2-allgather")
def test_kept_set_log_probs_at_allgather_cp2_equal_cp1(ranks):
    held = [rank["held"] for rank in ranks]
    assert all(sum(h) for h in held) and [sum(col) for col in zip(*held)] == list(RESPONSES), held
    assert held[0][1] and held[1][1]  # sample 1's response is cut between the ranks
    for rank in ranks:
        assert rank["renormalized"] > 1e-2  # the nuclei are strict subsets: the kept set changes the log-probs
        assert rank["same_names"]
        assert rank["kept"] <= REL and rank["grads"] <= REL, rank


def test_a_wrong_row_mapping_gives_other_kept_log_probs(ranks):
    for rank in ranks:
        assert rank["wrong"] > 1e-2, rank
