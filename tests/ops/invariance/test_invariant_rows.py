"""The invariant mode on one rank: a row's outputs are the same bits whatever rows surround it (count,
content, position), however the batch is chunked, padded or row-masked, for every vocabulary op, in
fp32 and bf16; the checker reports a function whose rows move with the batch (so these tests can
fail); values and gradients stay exact against float64 and nothing [T, V] is saved. Whether an op
ran its invariant code is observed directly (`counting_invariant_calls`), not read off bits: its two
modes' bits may coincide on one CPU's kernels (on one CPU rank the default mode of the logits ops
keeps its rows' bits too, each row's reduction running alone; the case where their default mode
moves is the tensor-parallel split, test_invariant_tp.py)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_rl_patches import ops
from megatron_rl_patches.testing.invariance import check_rows_invariant, counting_invariant_calls

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=25)

V, H, K = 300, 32, 4
WATCHED = 6


def _weight(dtype, seed=3, vocab=V, hidden=H):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, hidden, generator=g) / hidden**0.5 * 4).to(dtype)


def _rows(n, seed, dtype, scale=1.0, vocab=V, hidden=H):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, hidden, generator=g) * scale).to(dtype)
    tokens = torch.randint(0, vocab, (n,), generator=g)
    ids = torch.argsort(torch.rand(n, vocab, generator=g), dim=1)[:, :K]
    tau = torch.rand(n, generator=g).add(0.5)
    teacher = torch.log_softmax(torch.randn(n, K + 1, generator=g), dim=-1)
    x = (torch.randn(n, vocab, generator=g) * 3 * scale).to(dtype)  # the logits ops' own rows
    return h, tokens, ids, tau, teacher, x


def _ops(weight, chunk, invariant=True):
    """Per-row functions of (hidden, tokens, ids, τ, teacher buckets, logits) for every op (the
    logits ops get logits rows of their own: a GEMM over the batch would make them depend on T)."""

    def logits(x):
        return x.float()

    return {
        "log_probs_and_entropy": lambda h, t, i, tau, q, x: ops.log_probs_and_entropy(
            logits(x), t, temperature=tau, with_entropy=True, chunk_size=chunk, invariant=invariant),
        "log_probs_and_entropy/bf16 logits": lambda h, t, i, tau, q, x: ops.log_probs_and_entropy(
            x.bfloat16(), t, with_entropy=True, chunk_size=chunk, invariant=invariant),
        "topk_logprobs": lambda h, t, i, tau, q, x: ops.topk_logprobs(logits(x), i, temperature=tau, chunk_size=chunk,
                                                                   invariant=invariant),
        "topk_opd_loss": lambda h, t, i, tau, q, x: ops.topk_opd_loss(logits(x), i, q[:, :K], q[:, K],
                                                                   chunk_size=chunk, invariant=invariant),
        "topk_kl": lambda h, t, i, tau, q, x: ops.topk_kl(*ops.topk_logprobs(logits(x), i, invariant=invariant),
                                                       q[:, :K], divergence="jsd", invariant=invariant),
        "lm_head_log_probs_and_entropy": lambda h, t, i, tau, q, x: ops.lm_head_log_probs_and_entropy(
            h, weight, t, temperature=tau, with_entropy=True, chunk_size=chunk, invariant=invariant),
        "lm_head_topk_ids": lambda h, t, i, tau, q, x: ops.lm_head_topk_ids(h, weight, K, chunk_size=chunk,
                                                                         invariant=invariant),
        "lm_head_topk_logprobs": lambda h, t, i, tau, q, x: ops.lm_head_topk_logprobs(
            h, weight, i, temperature=tau, chunk_size=chunk, invariant=invariant),
    }


@SETTINGS
@given(n_others=st.integers(0, 70), seed=st.integers(0, 2**16), scale=st.sampled_from([0.1, 1.0, 8.0]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), chunk=st.sampled_from([None, 1, 5, 64]),
       op=st.sampled_from(sorted(_ops(torch.zeros(1, 1), None))))
def test_rows_surrounded_by_any_rows_keep_their_bits(n_others, seed, scale, dtype, chunk, op):
    weight = _weight(dtype)
    watched = _rows(WATCHED, 7, dtype)
    others = _rows(max(n_others, 1), seed, dtype, scale)
    if n_others == 0:  # padding only: zero rows (what a padded batch holds)
        others = (torch.zeros_like(others[0]),) + others[1:]
    report = check_rows_invariant(_ops(weight, chunk)[op], watched, others)
    assert report.identical, (op, report)


@SETTINGS
@given(seed=st.integers(0, 2**16), op=st.sampled_from(["lm_head_log_probs_and_entropy", "log_probs_and_entropy",
                                                         "lm_head_topk_logprobs"]))
def test_row_mask_and_chunking_change_no_selected_row(seed, op):
    """Padding rows masked out (row_mask) or a packed batch split in calls: the same bits per row."""
    weight = _weight(torch.float32)
    h, tokens, ids, tau, _, x = _rows(40, seed, torch.float32)
    mask = torch.rand(40, generator=torch.Generator().manual_seed(seed)) > 0.4
    call = {
        "lm_head_log_probs_and_entropy": lambda rows, **kw: ops.lm_head_log_probs_and_entropy(
            h[rows], weight, tokens[rows], with_entropy=True, invariant=True, **kw),
        "log_probs_and_entropy": lambda rows, **kw: ops.log_probs_and_entropy(
            x[rows], tokens[rows], with_entropy=True, invariant=True, **kw),
        "lm_head_topk_logprobs": lambda rows, **kw: ops.lm_head_topk_logprobs(h[rows], weight, ids[rows],
                                                                              invariant=True, **kw),
    }[op]
    every = slice(None)
    packed = call(every)
    masked = call(every, row_mask=mask)
    split = [call(slice(0, 13)), call(slice(13, 40))]  # two micro-batches
    for j, whole in enumerate(packed):
        assert torch.equal(masked[j][mask], whole[mask])
        assert torch.equal(torch.cat([part[j] for part in split]), whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_beside_2000_rows_keeps_its_bits_and_a_row_count_dependence_shows(dtype):
    """The measured case (16 rows, H = 256, V = 5000). The negative control, the same on every CPU:
    the same op with its values shifted by 2^-10 per row in the call (a row that depends on its
    batch, as a GEMM whose blocking followed T would) is reported at every placement. (Whether the
    default mode's GEMM moves these rows is the CPU's BLAS's choice: no control rests on it.)"""
    vocab, hidden = 5000, 256
    weight = _weight(dtype, vocab=vocab, hidden=hidden)
    watched = _rows(16, 1, dtype, vocab=vocab, hidden=hidden)[:2]
    others = _rows(2000, 2, dtype, vocab=vocab, hidden=hidden)[:2]

    def invariant(h, t):
        return ops.lm_head_log_probs_and_entropy(h, weight, t, with_entropy=True, invariant=True)

    def batch_dependent(h, t):
        return tuple(out + h.size(0) * 2.0**-10 for out in invariant(h, t))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = check_rows_invariant(invariant, watched, others)
        control = check_rows_invariant(batch_dependent, watched, others)
    finally:
        torch.set_num_threads(threads)  # the session's other tests keep their threads
    assert report.identical, report
    # reported, at every placement, by 2000 rows · 2^-10
    assert not control.identical and all(diff > 1.9 for diff in control.max_abs_diff.values()), control


@pytest.mark.parametrize("op", sorted(_ops(torch.zeros(1, 1), None)))
def test_each_op_runs_its_invariant_code_only_in_the_invariant_mode(op):
    """The negative control of the row checks above on one rank, observed on every CPU: every op
    called with invariant=True runs the invariant backend (counting_invariant_calls: statistics,
    ids), with invariant=False no invariant code at all, so an op that ignored `invariant=` would
    fail here; both modes' values agree within fp32 rounding (the ids ops: the same ids, both
    exact). topk_kl's own switch: the test below."""
    weight = _weight(torch.float32)
    rows = _rows(40, 7, torch.float32)
    modes, calls = {}, {}
    for inv in (True, False):
        with counting_invariant_calls() as calls[inv]:
            modes[inv] = _ops(weight, None, inv)[op](*rows)
    assert calls[True].backend > 0 and calls[False].count == 0, (op, calls)
    pairs = list(zip(*(m if isinstance(m, tuple) else (m,) for m in modes.values()), strict=True))
    for a, b in pairs:
        if op.endswith("topk_ids"):
            assert torch.equal(a, b), op
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=op)


def test_topk_kl_runs_its_rows_in_fixed_blocks_only_in_the_invariant_mode():
    """topk_kl's own `invariant=` (its buckets given): the fixed row blocks run in that mode only."""
    _, _, ids, _, teacher, x = _rows(40, 7, torch.float32)
    student = ops.topk_logprobs(x, ids, invariant=True)
    calls = {}
    for inv in (True, False):
        with counting_invariant_calls() as calls[inv]:
            ops.topk_kl(*student, teacher[:, :K], divergence="jsd", invariant=inv)
    assert calls[True].by_method == {"in_row_blocks": 1} and calls[False].count == 0, calls


def _reference(h, w, tokens, tau):
    z = (h.double() @ w.double().t()) / tau.double()[:, None]
    logp = torch.log_softmax(z, dim=-1)
    return logp.gather(1, tokens[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("route", ["logits", "fused"])
def test_values_and_gradients_exact_against_float64_and_nothing_vocab_wide_saved(route):
    """fp32 logits against float64 on the same logits; the fused head in float64 (an fp32 GEMM's own
    rounding would hide the op's)."""
    dtype = torch.float64 if route == "fused" else torch.float32
    weight = _weight(dtype)
    h, tokens, _, tau, _, _ = _rows(37, 5, dtype)
    saved: list[tuple[int, ...]] = []

    def keep(t):
        saved.append(tuple(t.shape))
        return t

    h_ = h.clone().requires_grad_()
    w_ = weight.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        if route == "fused":
            logp, ent = ops.lm_head_log_probs_and_entropy(h_, w_, tokens, temperature=tau, with_entropy=True,
                                                          invariant=True)
        else:
            x = (h_ @ w_.t()).detach().requires_grad_()
            logp, ent = ops.log_probs_and_entropy(x, tokens, temperature=tau, with_entropy=True, invariant=True)
    g = torch.Generator().manual_seed(9)
    a, b = torch.randn(37, generator=g), torch.randn(37, generator=g)
    (logp * a + ent * b).sum().backward()
    hd, wd = h.double().requires_grad_(), weight.double().requires_grad_()
    if route == "fused":
        ref_logp, ref_ent = _reference(hd, wd, tokens, tau)
        (ref_logp * a.double() + ref_ent * b.double()).sum().backward()
    else:
        ref_logp, ref_ent = _reference_z(x.detach().double(), tokens, tau)
    assert _within(logp, ref_logp), float((logp.double() - ref_logp).abs().max())
    assert _within(ent, ref_ent), float((ent.double() - ref_ent).abs().max())
    if route == "fused":
        assert (h_.grad.double() - hd.grad).abs().max() < 1e-6 * max(1.0, float(hd.grad.abs().max()))
        assert (w_.grad.double() - wd.grad).abs().max() < 1e-6 * max(1.0, float(wd.grad.abs().max()))
        assert all(shape[-1] != V for shape in saved if len(shape) == 2 and shape[0] == 37)  # no [T, V]
    else:
        z = x.detach().double().requires_grad_()
        zl, ze = _reference_z(z, tokens, tau)
        (zl * a.double() + ze * b.double()).sum().backward()
        assert (x.grad.double() - z.grad).abs().max() < 1e-6
        assert sum(1 for shape in saved if shape == (37, V)) <= 1  # the logits themselves, nothing more


def _within(got, ref):
    """|got - ref| < 2e-6, or within two steps of got's dtype at ref where a step is larger (fp32
    log-probs beyond -16 step by 1.9e-6: 2e-6 would be one rounding, which the scalar kernels,
    ATEN_CPU_CAPABILITY=default, exceed by 4 % on one row; smaller values keep 2e-6)."""
    step = torch.finfo(got.dtype).eps * torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))))
    return bool(((got.double() - ref).abs() < torch.clamp(2 * step, min=2e-6)).all())


def _reference_z(z, tokens, tau):
    logp = torch.log_softmax(z / tau.double()[:, None], dim=-1)
    return logp.gather(1, tokens[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)
