"""log_probs_and_entropy against float64 references: values, gradients, options, memory, errors."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl_patches.ops import _vocab
from megatron_rl_patches.ops.logprobs import log_probs_and_entropy
from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.logprob_reference import kept_ids, reference_log_probs, scaled_logits

# ---------------------------------------------------------------- float64 references


reference = reference_log_probs  # the one float64 reference (megatron_rl_patches.testing)


def reference_grad(logits, tokens, a, b, *, temperature=1.0, keep_mask=None, vocab_size=None):
    """Closed-form float64 dL/dlogits of L = Σ a·logp + b·H; -inf entries contribute 0."""
    z = scaled_logits(logits, temperature, vocab_size)
    p = torch.softmax(z, dim=-1)
    logp = torch.where(p > 0, torch.log_softmax(z, dim=-1), 0.0)
    entropy = -(p * logp).sum(-1, keepdim=True)
    pk = p
    if keep_mask is not None:
        pk = torch.softmax(z.masked_fill(~kept_ids(keep_mask, tokens, z.size(1)), -math.inf), dim=-1)
    onehot = torch.zeros_like(z)
    onehot[torch.arange(tokens.numel()), tokens] = 1.0
    g = a.double()[:, None] * (onehot - pk) - b.double()[:, None] * p * (logp + entropy)
    g = g / (temperature.double().reshape(-1, 1) if isinstance(temperature, torch.Tensor) else temperature)
    full = torch.zeros(logits.shape, dtype=torch.float64)
    full[:, : g.size(1)] = g
    return full


def ours_with_grad(logits, tokens, a, b, **kwargs):
    x = logits.detach().clone().requires_grad_()
    lp, ent = log_probs_and_entropy(x, tokens, **kwargs)
    loss = (lp * a.to(lp.dtype)).sum()
    if ent is not None and ent.requires_grad:
        loss = loss + (ent * b.to(ent.dtype)).sum()
    loss.backward()
    return lp.detach(), (ent.detach() if ent is not None else None), x.grad


def assert_logprobs_close(actual, expected, rel=1e-6):
    tol = rel * expected.abs().clamp_min(1.0)
    err = (actual.double() - expected).abs()
    assert bool((err <= tol).all()), f"log-prob error {err.max().item():.3g} > {rel} x max(1, |ref|)"


def assert_grad_close(actual, expected, rel=1e-6):
    # Floor: when every entry is ~1e-18 (one confident token, p = 1 - 1e-18), fp32 noise of ~1e-17
    # is meaningless next to the upstream gradient's own scale (|dL/dlogp| ~ 1).
    tol = rel * expected.abs().max().clamp_min(1e-6)
    err = (actual.double() - expected).abs().max()
    assert err <= tol, f"gradient error {err.item():.3g} > {rel} x largest reference entry ({tol.item():.3g})"


def make(T=23, V=97, *, seed=0, scale=3.0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, V, generator=g) * scale + shift
    tokens = torch.randint(0, V, (T,), generator=g)
    a = torch.randn(T, generator=g)
    b = torch.randn(T, generator=g)
    return logits, tokens, a, b


# ---------------------------------------------------------------- accuracy


@pytest.mark.parametrize("shift", [0.0, 30.0])
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_fp32_matches_float64_reference(shift, entropy_grad):
    logits, tokens, a, b = make(T=41, V=301, shift=shift, scale=4.0)
    lp, ent, grad = ours_with_grad(logits, tokens, a, b, with_entropy=True, entropy_requires_grad=entropy_grad)
    ref_lp, ref_ent = reference(logits, tokens)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    assert_logprobs_close(lp, ref_lp)
    assert (ent.double() - ref_ent).abs().max() <= 1e-5
    assert_grad_close(grad, reference_grad(logits, tokens, a, b if entropy_grad else torch.zeros_like(b)))


def test_closed_form_reference_matches_autograd():
    """The closed-form gradient used as reference agrees with autograd through the unfused math."""
    logits, tokens, a, b = make(T=9, V=31, seed=3)
    keep = torch.rand(9, 31, generator=torch.Generator().manual_seed(4)) < 0.4
    x = logits.double().requires_grad_()
    lp, ent = reference(x, tokens, temperature=0.7, keep_mask=keep)
    ((lp * a.double()).sum() + (ent * b.double()).sum()).backward()
    closed = reference_grad(logits.double(), tokens, a, b, temperature=0.7, keep_mask=keep)
    assert torch.allclose(x.grad, closed, atol=1e-12)


def test_chunk_sizes_agree():
    """Chunking only changes which rows share a pass: results agree to 1e-7 relative (bitwise here)."""
    T = 50
    logits, tokens, a, b = make(T=T, V=257, seed=5)
    keep = torch.rand(T, 257, generator=torch.Generator().manual_seed(6)) < 0.5
    base = ours_with_grad(logits, tokens, a, b, with_entropy=True, chunk_size=T, keep_mask=keep, temperature=0.9)
    for chunk in (1, 7, 256):
        other = ours_with_grad(logits, tokens, a, b, with_entropy=True, chunk_size=chunk, keep_mask=keep,
                               temperature=0.9)
        for x, y in zip(other, base):
            torch.testing.assert_close(x, y, rtol=1e-7, atol=1e-7)


def test_default_chunk_rows_follow_byte_budget():
    rows = _vocab.default_chunk_rows(32000, "cpu")
    assert rows * 32000 * 4 <= _vocab.CPU_CHUNK_BYTES < (rows + 1) * 32000 * 4
    assert _vocab.default_chunk_rows(10**9, "cpu") == 1
    assert _vocab.default_chunk_rows(1000, "cuda") * 1000 * 4 <= _vocab.CUDA_CHUNK_BYTES


def test_empty_input_returns_empty_outputs():
    logits = torch.zeros(0, 11, requires_grad=True)
    lp, ent = log_probs_and_entropy(logits * 1.0, torch.zeros(0, dtype=torch.long), with_entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert logits.grad.shape == (0, 11)
    lp, ent = log_probs_and_entropy(torch.zeros(0, 11), torch.zeros(0, dtype=torch.long))
    assert lp.shape == (0,) and ent is None


def test_keep_mask_renormalizes_log_prob_only():
    logits, tokens, a, b = make(T=30, V=64, seed=7)
    keep = torch.rand(30, 64, generator=torch.Generator().manual_seed(8)) < 0.25
    keep[3] = False  # nothing kept: only the target counts (log-prob 0)
    keep[4, tokens[4]] = False  # the target is counted even when the mask omits it
    lp, ent, grad = ours_with_grad(logits, tokens, a, b, with_entropy=True, keep_mask=keep)
    ref_lp, ref_ent = reference(logits, tokens, keep_mask=keep)
    assert_logprobs_close(lp, ref_lp)
    assert lp[3].abs() < 1e-6
    assert (ent.double() - ref_ent).abs().max() <= 1e-5  # entropy of the unmasked distribution
    assert_grad_close(grad, reference_grad(logits, tokens, a, b, keep_mask=keep))
    # log-prob only (no entropy work) takes the other backward branch
    lp2, _, grad2 = ours_with_grad(logits, tokens, a, b, keep_mask=keep)
    assert_grad_close(grad2, reference_grad(logits, tokens, a, torch.zeros_like(b), keep_mask=keep))


def test_keep_mask_far_below_the_max():
    """Kept ids 60-200 below the row max (kept mass < e^-40) still give exact log-probs and grads."""
    logits, tokens, a, b = make(T=6, V=40, seed=9, scale=1.0)
    keep = torch.zeros(6, 40, dtype=torch.bool)
    keep[:, 10:20] = True
    tokens[:] = 15
    logits[:, 0] = torch.tensor([60.0, 100.0, 200.0, 10.0, 45.0, 0.0])  # rows 3, 5: near, rows 0-2, 4: far
    lp, ent, grad = ours_with_grad(logits, tokens, a, b, with_entropy=True, keep_mask=keep)
    ref_lp, ref_ent = reference(logits, tokens, keep_mask=keep)
    assert_logprobs_close(lp, ref_lp)
    assert (ent.double() - ref_ent).abs().max() <= 1e-5
    assert_grad_close(grad, reference_grad(logits, tokens, a, b, keep_mask=keep))
    _, _, grad2 = ours_with_grad(logits, tokens, a, b, keep_mask=keep)
    assert_grad_close(grad2, reference_grad(logits, tokens, a, torch.zeros_like(b), keep_mask=keep))


def test_vocab_size_excludes_padded_columns():
    logits, tokens, a, b = make(T=12, V=50, seed=10)
    tokens = tokens % 45
    logits[:, 45:] = torch.tensor([1e4, -3.0, math.nan, math.inf, 7.0])  # padding garbage is never read
    lp, ent, grad = ours_with_grad(logits, tokens, a, b, with_entropy=True, vocab_size=45)
    ref_lp, ref_ent = reference(logits, tokens, vocab_size=45)
    assert_logprobs_close(lp, ref_lp)
    assert (ent.double() - ref_ent).abs().max() <= 1e-5
    assert torch.all(grad[:, 45:] == 0)
    assert_grad_close(grad, reference_grad(logits, tokens, a, b, vocab_size=45))


@pytest.mark.parametrize("per_token", [False, True])
def test_temperature_equals_scaled_logits(per_token):
    logits, tokens, a, b = make(T=20, V=80, seed=11)
    tau = torch.rand(20, generator=torch.Generator().manual_seed(12)) + 0.3 if per_token else 0.6
    lp, ent, grad = ours_with_grad(logits, tokens, a, b, with_entropy=True, temperature=tau)
    ref_lp, ref_ent = reference(logits, tokens, temperature=tau)
    assert_logprobs_close(lp, ref_lp)
    assert (ent.double() - ref_ent).abs().max() <= 1e-5
    assert_grad_close(grad, reference_grad(logits, tokens, a, b, temperature=tau))
    # same as handing over logits/τ, the gradient carrying the extra 1/τ
    scaled = logits / (tau.unsqueeze(1) if per_token else tau)
    lp2, ent2, grad2 = ours_with_grad(scaled, tokens, a, b, with_entropy=True)
    torch.testing.assert_close(lp, lp2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent, ent2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, grad2 / (tau.unsqueeze(1) if per_token else tau), rtol=1e-5, atol=1e-6)


def test_negative_infinity_entries_are_legal():
    logits, tokens, a, b = make(T=10, V=30, seed=13)
    logits[:, ::3] = -math.inf
    tokens[0] = 0  # a -inf target: log-prob -inf, gradient still finite
    tokens[1:] = 1
    lp, ent, grad = ours_with_grad(logits, tokens, a.clone().index_fill_(0, torch.tensor([0]), 0.0), b,
                                   with_entropy=True)
    ref_lp, ref_ent = reference(logits, tokens)
    assert lp[0] == -math.inf
    assert_logprobs_close(lp[1:], ref_lp[1:])
    assert (ent.double() - ref_ent).abs().max() <= 1e-5
    assert torch.isfinite(grad).all()
    assert_grad_close(grad, reference_grad(logits, tokens, a.clone().index_fill_(0, torch.tensor([0]), 0.0), b))


@layouts.mark("bf16")
def test_bf16_logits_math_in_fp32():
    logits, tokens, a, b = make(T=16, V=128, seed=14)
    low = logits.bfloat16()
    lp, ent, grad = ours_with_grad(low, tokens, a, b, with_entropy=True)
    ref_lp, ref_ent = reference(low, tokens)  # the same bf16 values, in float64
    assert lp.dtype == torch.float32 and grad.dtype == torch.bfloat16
    assert_logprobs_close(lp, ref_lp)
    assert (ent.double() - ref_ent).abs().max() <= 1e-5
    ref_grad = reference_grad(low, tokens, a, b)
    assert (grad.double() - ref_grad).abs().max() <= 1e-2 * ref_grad.abs().max()  # bf16 storage of the grad


def test_fp64_logits_computed_in_fp64():
    logits, tokens, a, b = make(T=16, V=64, seed=15)
    logits = logits.double()
    lp, ent, grad = ours_with_grad(logits, tokens, a, b, with_entropy=True, temperature=0.8)
    ref_lp, ref_ent = reference(logits, tokens, temperature=0.8)
    assert lp.dtype == torch.float64
    assert (lp - ref_lp).abs().max() < 1e-12 and (ent - ref_ent).abs().max() < 1e-12
    assert (grad - reference_grad(logits, tokens, a, b, temperature=0.8)).abs().max() < 1e-12


def test_entropy_only_and_logprob_only_losses():
    logits, tokens, a, b = make(T=8, V=40, seed=16)
    x = logits.clone().requires_grad_()
    _, ent = log_probs_and_entropy(x, tokens, with_entropy=True)
    (ent * b).sum().backward()
    assert_grad_close(x.grad, reference_grad(logits, tokens, torch.zeros_like(a), b))
    x.grad = None
    lp, _ = log_probs_and_entropy(x, tokens, with_entropy=True)
    (lp * a).sum().backward()
    assert_grad_close(x.grad, reference_grad(logits, tokens, a, torch.zeros_like(b)))


def test_input_untouched_and_non_contiguous_logits():
    wide, tokens, a, b = make(T=10, V=60, seed=17)
    logits = wide[:, 5:45]  # a column slice: rows are strided
    tokens = tokens % 40
    before = logits.clone()
    x = logits.clone().requires_grad_()
    lp, ent = log_probs_and_entropy(logits, tokens, with_entropy=True)
    assert torch.equal(logits, before)
    lp2, ent2, grad = ours_with_grad(logits.contiguous(), tokens, a, b, with_entropy=True)
    torch.testing.assert_close(lp, lp2, rtol=0, atol=0)
    leaf = wide.clone().requires_grad_()
    lp3, ent3 = log_probs_and_entropy(leaf[:, 5:45], tokens, with_entropy=True)
    ((lp3 * a).sum() + (ent3 * b).sum()).backward()
    torch.testing.assert_close(leaf.grad[:, 5:45], grad, rtol=0, atol=0)
    assert torch.all(leaf.grad[:, :5] == 0) and torch.equal(leaf.detach(), wide)
    del x


def test_no_grad_mode_returns_values():
    logits, tokens, _, _ = make(T=5, V=20, seed=18)
    with torch.no_grad():
        lp, ent = log_probs_and_entropy(logits.requires_grad_(), tokens, with_entropy=True)
    assert not lp.requires_grad
    ref_lp, ref_ent = reference(logits.detach(), tokens)
    assert_logprobs_close(lp, ref_lp)


# ---------------------------------------------------------------- in-place backward


def test_inplace_backward_writes_the_gradient_into_the_logits():
    logits, tokens, a, b = make(T=14, V=33, seed=19)
    _, _, fresh = ours_with_grad(logits, tokens, a, b, with_entropy=True)
    base = logits.clone().requires_grad_()
    x = base * 1.0  # a non-leaf, as an LM head output
    pointer = x.data_ptr()
    lp, ent = log_probs_and_entropy(x, tokens, with_entropy=True, inplace_backward=True)
    ((lp * a).sum() + (ent * b).sum()).backward()
    torch.testing.assert_close(base.grad, fresh, rtol=0, atol=0)
    assert x.data_ptr() == pointer and torch.equal(x.detach(), fresh)  # the logits now hold the gradient


def test_inplace_backward_misuse_raises_instead_of_corrupting():
    logits, tokens, a, _ = make(T=6, V=20, seed=20)
    base = logits.clone().requires_grad_()
    x = base * 1.0
    other = (x**2).sum()  # another node saved the logits for its backward
    lp, _ = log_probs_and_entropy(x, tokens, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        ((lp * a).sum() + other).backward()


def test_inplace_backward_rejects_leaves_and_overlapping_rows():
    logits, tokens, _, _ = make(T=4, V=10, seed=21)
    leaf = logits.clone().requires_grad_()
    with pytest.raises(ValueError, match="leaf"):
        log_probs_and_entropy(leaf, tokens, inplace_backward=True)
    expanded = (logits[:1] * torch.ones((), requires_grad=True)).expand(4, 10)
    with pytest.raises(ValueError, match="overlap"):
        log_probs_and_entropy(expanded, tokens, inplace_backward=True)


# ---------------------------------------------------------------- what is kept for backward


class SavedLog:
    """Tensors saved for backward while active (storage pointer, bytes, shape, dtype)."""

    def __init__(self):
        self.items = []

    def pack(self, t):
        self.items.append((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), tuple(t.shape), t.dtype))
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


@pytest.mark.parametrize("masked", [False, True])
def test_saves_logits_plus_at_most_24_bytes_per_token(masked):
    T, V = 64, 500
    logits, tokens, _, _ = make(T=T, V=V, seed=22)
    keep = torch.rand(T, V) < 0.5 if masked else None
    x = logits.clone().requires_grad_() * 1.0
    with SavedLog() as log:
        log_probs_and_entropy(x, tokens, with_entropy=True, keep_mask=keep, temperature=0.7)
    inputs = {x.untyped_storage().data_ptr()} | ({keep.untyped_storage().data_ptr()} if masked else set())
    own = [(ptr, nbytes) for ptr, nbytes, _, _ in log.items if ptr not in inputs]
    assert x.untyped_storage().data_ptr() in {ptr for ptr, *_ in log.items}  # save_for_backward(logits)
    assert sum(nbytes for _, nbytes in dict(own).items()) <= 24 * T


def test_entropy_without_grad_saves_nothing_extra_and_same_logprob_grads():
    logits, tokens, a, _ = make(T=32, V=100, seed=23)
    runs = {}
    for name, kwargs in {"metric": dict(with_entropy=True, entropy_requires_grad=False), "none": {}}.items():
        x = logits.clone().requires_grad_()
        with SavedLog() as log:
            lp, ent = log_probs_and_entropy(x, tokens, **kwargs)
        (lp * a).sum().backward()
        runs[name] = ([(shape, dtype) for _, _, shape, dtype in log.items], x.grad, ent)
    assert runs["metric"][0] == runs["none"][0]
    assert torch.equal(runs["metric"][1], runs["none"][1])
    assert runs["metric"][2] is not None and not runs["metric"][2].requires_grad


# ---------------------------------------------------------------- errors


def _bad_cases():
    logits, tokens, _, _ = make(T=5, V=10, seed=24)
    nan = logits.clone()
    nan[3, 2] = math.nan
    pinf = logits.clone()
    pinf[1, 0] = math.inf
    ninf = logits.clone()
    ninf[2] = -math.inf
    kept_inf = logits.clone()
    kept_inf[0, :5] = -math.inf
    mask = torch.zeros(5, 10, dtype=torch.bool)
    mask[0, :5] = True
    t_kept = tokens.clone()
    t_kept[0] = 1
    return [
        (dict(logits=logits[None]), ValueError, "2-D"),
        (dict(tokens=tokens[:4]), ValueError, "shape"),
        (dict(tokens=tokens.float()), TypeError, "integer"),
        (dict(tokens=tokens + 10), ValueError, r"\[0, 10\)"),
        (dict(tokens=tokens - 10), ValueError, r"\[0, 10\)"),
        (dict(logits=logits.long()), TypeError, "floating"),
        (dict(logits=nan), ValueError, r"rows \[3\].*NaN"),
        (dict(logits=pinf), ValueError, r"rows \[1\].*\+inf"),
        (dict(logits=ninf), ValueError, r"rows \[2\].*entirely -inf"),
        (dict(logits=kept_inf, tokens=t_kept, keep_mask=mask), ValueError, r"rows \[0\].*kept"),
        (dict(keep_mask=mask[:, :9]), ValueError, "keep_mask"),
        (dict(keep_mask=mask.float()), TypeError, "keep_mask"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(temperature=torch.tensor([1.0, 1, 1, -1, 1])), ValueError, "temperature"),
        (dict(temperature=torch.ones(4)), ValueError, "temperature"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(vocab_size=11), ValueError, "vocab_size"),
        (dict(vocab_size=5, tokens=tokens.clamp_min(5)), ValueError, r"\[0, 5\)"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_inputs_raise_and_change_nothing(case):
    logits, tokens, _, _ = make(T=5, V=10, seed=24)
    change, exc, pattern = _bad_cases()[case]
    kwargs = {"logits": logits, "tokens": tokens, **change}
    snapshot = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(exc, match=pattern):
        log_probs_and_entropy(kwargs.pop("logits"), kwargs.pop("tokens"), with_entropy=True, **kwargs)
    for name, before in snapshot.items():
        after = {"logits": logits, "tokens": tokens, **change}[name]
        assert torch.equal(after.nan_to_num(), before.nan_to_num()), name


def test_tp_group_without_distributed_is_rejected():
    logits, tokens, _, _ = make(T=2, V=4)
    with pytest.raises(ValueError, match="not initialized"):
        log_probs_and_entropy(logits, tokens, tp_group=object())


# ---------------------------------------------------------------- properties


@settings(max_examples=40, deadline=None)
@given(
    T=st.integers(0, 9),
    V=st.integers(1, 37),
    seed=st.integers(0, 2**31 - 1),
    chunk=st.integers(1, 11),
    shift=st.sampled_from([0.0, -25.0, 30.0]),
    scale=st.sampled_from([0.01, 1.0, 8.0]),
    tau=st.sampled_from([1.0, 0.5, 1.7, "per-token"]),
    masked=st.booleans(),
    padded=st.integers(0, 3),
    entropy_grad=st.booleans(),
)
def test_property_matches_reference(T, V, seed, chunk, shift, scale, tau, masked, padded, entropy_grad):
    logits, tokens, a, b = make(T=T, V=V + padded, seed=seed, scale=scale, shift=shift)
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, V, (T,), generator=g)
    temperature = torch.rand(T, generator=g) + 0.4 if tau == "per-token" else tau
    keep = torch.rand(T, V + padded, generator=g) < 0.5 if masked else None
    vocab_size = V if padded else None
    lp, ent, grad = ours_with_grad(logits, tokens, a, b, with_entropy=True, entropy_requires_grad=entropy_grad,
                                   chunk_size=chunk, keep_mask=keep, vocab_size=vocab_size, temperature=temperature)
    ref_lp, ref_ent = reference(logits, tokens, temperature=temperature, keep_mask=keep, vocab_size=vocab_size)
    assert lp.shape == (T,) and ent.shape == (T,) and grad.shape == logits.shape
    assert_logprobs_close(lp, ref_lp)
    assert bool(((ent.double() - ref_ent).abs() <= 1e-5).all())
    assert torch.all(ent >= -1e-5) and torch.all(lp <= 1e-6)
    ref_grad = reference_grad(logits, tokens, a, b if entropy_grad else torch.zeros_like(b),
                              temperature=temperature, keep_mask=keep, vocab_size=vocab_size)
    if T:
        assert_grad_close(grad, ref_grad)
        # softmax gradients sum to zero over the vocab for every row
        assert grad.double().sum(1).abs().max() <= 1e-5 * max(1.0, ref_grad.abs().max().item())
