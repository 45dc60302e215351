"""The shared statistics core (ops/_stats.py) and what every vocab-parallel op gets from it:
float64-checked statistics under any tiling, one host sync per call, one validation behaviour."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_rl_patches import log_probs_and_entropy, topk_ids, topk_logprobs, topk_opd_loss
from megatron_rl_patches.ops import _stats, topk_select
from megatron_rl_patches.ops._checks import DeviceChecks
from megatron_rl_patches.testing.logprob_reference import scaled_logits

# Tests of the deprecated kl=/mix= (and of forms reachable only through them): opted out of the
# suite-wide "the package's deprecations are errors" filter (pyproject.toml).
pytestmark = pytest.mark.filterwarnings("ignore:kl=/mix= are deprecated:DeprecationWarning")

INF = math.inf

# aten ops that make the host wait for the device on GPU (a scalar read, a data-dependent shape)
_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "equal", "unique_consecutive", "_unique2"}


class HostSyncs(TorchDispatchMode):
    """Counts, below autograd, the ops that force a device-to-host sync on GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())
        )
        # a copy to the host (only moving, no conversion): on GPU a device-to-host sync
        to_host = name == "_to_copy" and str((kwargs or {}).get("device", "")) == "cpu" and (
            (kwargs or {}).get("dtype") in (None, args[0].dtype)
        )
        if name in _SYNC_OPS or bool_index or to_host:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def count_syncs(fn):
    with HostSyncs() as mode:
        out = fn()
    return mode.ops, out


# ------------------------------------------------------------------------ host syncs per call


def _lp_inputs(T=40, V=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, V, generator=g) * 3
    tokens = torch.randint(0, V, (T,), generator=g)
    keep = torch.rand(T, V, generator=g) < 0.4
    keep[:5] = False
    keep[:5, :3] = True
    tokens[:5] = 1
    logits[:5, -1] = 80.0  # kept ids far below the row max: the own-shift path in both passes
    tau = torch.rand(T, generator=g) + 0.5
    return logits, tokens, keep, tau


@pytest.mark.parametrize("masked", [False, True])
def test_log_probs_host_syncs_do_not_grow_with_chunks(masked):
    """Forward: one sync (validation and bad rows at once), with or without keep_mask; backward: none."""
    logits, tokens, keep, tau = _lp_inputs()
    counts = {}
    for chunk in (1, 7, None):
        x = logits.clone().requires_grad_()
        fwd, (lp, ent) = count_syncs(lambda x=x, chunk=chunk: log_probs_and_entropy(
            x, tokens, with_entropy=True, temperature=tau, chunk_size=chunk, keep_mask=keep if masked else None))
        bwd, _ = count_syncs(lambda lp=lp, ent=ent: ((lp * 1.5).sum() + ent.sum()).backward())
        counts[chunk] = (fwd, bwd)
    assert counts[1] == counts[7] == counts[None], counts
    fwd, bwd = counts[1]
    assert len(fwd) == 1, fwd
    assert bwd == []


def test_topk_host_syncs_do_not_grow_with_chunks():
    g = torch.Generator().manual_seed(1)
    T, V, k = 30, 80, 5
    logits = torch.randn(T, V, generator=g) * 3
    logits[:4, :k] += 60.0  # tails e^-60 below: their own shift
    ids = topk_ids(logits, k)
    teachers = torch.log_softmax(torch.randn(2, T, V, generator=g), -1).gather(-1, ids.expand(2, T, k))
    tau = torch.rand(T, generator=g) + 0.5
    counts = {}
    for chunk in (1, 7, None):
        x = logits.clone().requires_grad_()
        fwd, (lp, tail) = count_syncs(lambda x=x, chunk=chunk: topk_logprobs(x, ids, temperature=tau, chunk_size=chunk))
        bwd, _ = count_syncs(lambda lp=lp, tail=tail: (lp.sum() + tail.sum()).backward())
        loss_fwd, loss = count_syncs(lambda x=x, chunk=chunk: topk_opd_loss(
            x, ids, teachers, teacher_weights=torch.tensor([1.0, 3.0]), kl="mixed", temperature=tau, chunk_size=chunk))
        loss_bwd, _ = count_syncs(lambda loss=loss: loss.sum().backward())
        counts[chunk] = (fwd, bwd, loss_fwd, loss_bwd)
    assert counts[1] == counts[7] == counts[None], counts
    fwd, bwd, loss_fwd, loss_bwd = counts[1]
    # one for all value checks (ids, temperature, weights) and bad rows at once
    assert len(fwd) == 1 and len(loss_fwd) == 1, (fwd, loss_fwd)
    assert bwd == [] and loss_bwd == []
    ids_syncs, _ = count_syncs(lambda: topk_ids(logits.bfloat16(), k))
    assert ids_syncs == ["_to_copy"], ids_syncs  # bad rows and the rows with a tie at the cut, at once


# ------------------------------------------------------------------------ the fold vs float64


def _fold_in_tiles(logits, marked, keep, scale, row_tile, col_tile, moment):
    """RowStats of `logits` folded tile by tile (row_tile x col_tile), as any backend may tile."""
    T, V = logits.shape
    stats = _stats.RowStats.empty(T, marked.size(1), torch.float32, logits.device, moment=moment, subset=True)
    owned = torch.ones_like(marked, dtype=torch.bool)
    for r0 in range(0, T, row_tile):
        rows = slice(r0, min(T, r0 + row_tile))
        for c0 in range(0, V, col_tile):
            cols = slice(c0, min(V, c0 + col_tile))
            marks = _stats.column_marks(marked[rows], owned[rows], c0, cols.stop - c0)
            _stats.fold_tile(stats, rows, logits[rows, cols], _stats.scale_rows(scale, rows), marks,
                             keep[rows, cols] if keep is not None else None)
    return stats


@settings(max_examples=30, deadline=None)
@given(
    T=st.integers(1, 9),
    V=st.integers(2, 40),
    k=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
    row_tile=st.integers(1, 5),
    col_tile=st.integers(1, 41),
    gap=st.sampled_from([0.0, 1.0, 30.0, 150.0]),
    masked=st.booleans(),
    per_token=st.booleans(),
)
def test_folded_statistics_match_float64_under_any_tiling(T, V, k, seed, row_tile, col_tile, gap, masked, per_token):
    k = min(k, V - 1)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, V, generator=g) * 2
    marked = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(T)])
    keep = torch.rand(T, V, generator=g) < 0.5 if masked else None
    # lift the marked columns by `gap`: the subset lies about that far below the row max
    logits.scatter_add_(1, marked, torch.full((T, k), gap))
    tau = torch.rand(T, generator=g) + 0.5 if per_token else 0.8
    scale = _stats.row_scale(tau, T, torch.float32)
    stats = _fold_in_tiles(logits, marked, keep, scale, row_tile, col_tile, moment=True)

    s64 = 1.0 / (tau.double()[:, None] if per_token else tau)
    z = logits.double() * s64
    is_marked = torch.zeros_like(z, dtype=torch.bool).scatter(1, marked, True)
    u = z - z.amax(1, keepdim=True)
    e = torch.where(is_marked, 0.0, u.exp())
    # the subset: the kept columns (the marked ones count for its max), else the tail
    subset = ~is_marked & (keep if masked else True)
    assert torch.equal(stats.shift, logits.amax(1))
    assert torch.equal(stats.marked, logits.gather(1, marked))
    # full-shift sums: accurate relative to the row's whole mass (terms far below it round at |u|·eps)
    total = u.exp().sum(1)
    assert bool(((stats.rest.double() - e.sum(1)).abs() <= 1e-6 * total).all())
    assert bool(((stats.moment.double() - (e * u).sum(1)).abs() <= 1e-6 * total).all())  # E_p[u] to 1e-6
    # the subset's own max and its sum with it: exact even e^-150 below the row max
    in_max = subset | (is_marked & masked)
    assert torch.equal(stats.sub_shift, torch.where(in_max, logits, -INF).amax(1))
    c = stats.sub_shift.double()[:, None] * s64
    ref = torch.where(subset, (z - c).exp(), 0.0).sum(1)
    scale_of = ref + (torch.where(is_marked, (z - c).exp(), 0.0).sum(1) if masked else 0.0)
    assert bool(((stats.sub_sum.double() - ref).abs() <= 1e-6 * scale_of.clamp_min(1e-30)).all())


@pytest.mark.parametrize("chunk", [1, 4, None])
def test_topk_far_tails_values_and_gradients_match_float64(chunk):
    """Tails e^-30..e^-90 below the ids (own shift, second exp in backward) mixed with near rows."""
    g = torch.Generator().manual_seed(4)
    T, V, k = 10, 90, 4
    x = torch.randn(T, V, generator=g) * 2
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(T)])
    lift = torch.tensor([30.0, 0.0, 90.0, 0.0, 45.0, 60.0, 0.0, 0.0, 35.0, 70.0])
    x.scatter_add_(1, ids, lift[:, None].expand(T, k))
    tau = torch.rand(T, generator=g) + 0.5
    g_lp, g_tail = torch.randn(T, k, generator=g), torch.randn(T, generator=g)
    xd = x.double().requires_grad_(True)
    logp = torch.log_softmax(scaled_logits(xd, tau, None), -1)
    rest = torch.ones_like(logp, dtype=torch.bool).scatter(1, ids, False)
    ref_lp, ref_tail = logp.gather(1, ids), torch.logsumexp(logp.masked_fill(~rest, -INF), -1)
    ((ref_lp * g_lp).sum() + (ref_tail * g_tail).sum()).backward()
    xs = x.clone().requires_grad_(True)
    lp, tail = topk_logprobs(xs, ids, temperature=tau, chunk_size=chunk)
    ((lp * g_lp).sum() + (tail * g_tail).sum()).backward()
    assert bool((ref_tail[lift > 0] < -15).all())
    torch.testing.assert_close(lp.double(), ref_lp.detach(), rtol=0, atol=2e-6)
    # the tail log-mass relative to its size: exact even at e^-100
    assert bool(((tail.double() - ref_tail.detach()).abs() <= 1e-6 * ref_tail.detach().abs().clamp_min(1)).all())
    assert (xs.grad.double() - xd.grad).abs().max() <= 1e-5 * xd.grad.abs().max()


def test_device_checks_one_sync_first_failure_wins():
    checks = DeviceChecks()
    checks.require(torch.tensor([True, True]), lambda: ValueError("never"))
    checks.require(torch.tensor([True, False]), lambda: ValueError("first"))
    checks.require(torch.tensor(False), lambda: TypeError("second"))
    checks.require(torch.zeros(0, dtype=torch.bool), lambda: ValueError("empty: nothing to check"))
    with HostSyncs() as mode, pytest.raises(ValueError, match="first"):
        checks.raise_first()
    assert mode.ops == ["_local_scalar_dense"]
    with HostSyncs() as mode:
        checks.raise_first()  # forgotten once raised
        ok = DeviceChecks()
        ok.require(torch.ones(3, dtype=torch.bool), lambda: ValueError("never"))
        ok.raise_first()
    assert mode.ops == ["_local_scalar_dense"]


# ------------------------------------------------------------------------ one validation for both ops


def test_both_ops_treat_temperature_alike():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 30, generator=g)
    tokens = torch.randint(0, 30, (6,), generator=g)
    ids = topk_ids(logits, 3)
    # a 0-d tensor is the same as its float, without a host read
    lp_f, _ = log_probs_and_entropy(logits, tokens, temperature=0.7)
    lp_t, _ = log_probs_and_entropy(logits, tokens, temperature=torch.tensor(0.7))
    torch.testing.assert_close(lp_t, lp_f, rtol=0, atol=1e-7)
    syncs_f, tk_f = count_syncs(lambda: topk_logprobs(logits, ids, temperature=0.7))
    syncs_t, tk_t = count_syncs(lambda: topk_logprobs(logits, ids, temperature=torch.tensor(0.7)))
    assert syncs_t == syncs_f  # checked with the ids in the call's one validation sync, never .item()
    torch.testing.assert_close(tk_t, tk_f, rtol=0, atol=1e-7)
    bad = [
        (torch.tensor(0.7, requires_grad=True), ValueError, "must not require grad"),
        (torch.ones(6, dtype=torch.long), TypeError, "floating"),
        (torch.ones(5), ValueError, "temperature tensor must have shape"),
        (torch.tensor([1.0, 1, 1, 0, 1, 1]), ValueError, "finite and > 0 for every token"),
        (True, TypeError, "temperature must be a float"),
        (-1.0, ValueError, "finite and > 0"),
    ]
    for tau, exc, match in bad:
        with pytest.raises(exc, match=match):
            log_probs_and_entropy(logits, tokens, temperature=tau)
        with pytest.raises(exc, match=match):
            topk_logprobs(logits, ids, temperature=tau)
    for call in (lambda: log_probs_and_entropy(logits, tokens, vocab_size=31),
                 lambda: topk_ids(logits, 3, vocab_size=31),
                 lambda: topk_logprobs(logits, ids, vocab_size=31)):
        with pytest.raises(ValueError, match=r"vocab_size must be in \[1, 30\]"):
            call()
    for call in (lambda: log_probs_and_entropy(logits, tokens, chunk_size=0),
                 lambda: topk_logprobs(logits, ids, chunk_size=0)):
        with pytest.raises(ValueError, match="chunk_size must be a positive int"):
            call()
    for call in (lambda: log_probs_and_entropy(logits, tokens, tp_group=object()),
                 lambda: topk_ids(logits, 3, tp_group=object()),
                 lambda: topk_logprobs(logits, ids, tp_group=object())):
        with pytest.raises(ValueError, match="not initialized"):
            call()


# ------------------------------------------------------------------------ top-k ids with bf16 ties


def _stable_topk(x, k):
    return torch.sort(x.double(), dim=-1, descending=True, stable=True).indices[:, :k]


def _select_in_tiles(x, k, width, chunk):
    """topk_select over column tiles `width` wide, ambiguous rows re-ranked `chunk` rows at a time."""
    run = topk_select.RunningTopk.empty(x.size(0), k, x.dtype, x.device, sentinel=x.size(1))
    for c0 in range(0, x.size(1), width):
        topk_select.fold_tile(run, slice(0, x.size(0)), x[:, c0:c0 + width], c0)
    tied = [row for row, flag in enumerate(topk_select.ambiguous_rows(run).tolist()) if flag]

    def row_tiles(listed, index):
        for r0 in range(0, len(listed), chunk):
            for c0 in range(0, x.size(1), width):
                yield slice(r0, r0 + chunk), slice(c0, c0 + width), x[index[r0:r0 + chunk], c0:c0 + width]

    if tied:
        topk_select.exact_rows(run, tied, row_tiles, 0, None)
    return run.ids


def test_topk_ids_bf16_ties_at_realistic_sizes():
    """bf16 logits tie at the k-th value in most rows: ids equal a stable sort, lower id first."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(96, 3000, generator=g) * 3).bfloat16()
    top = x.float().topk(33).values
    assert (top[:, 31] == top[:, 32]).float().mean() > 0.2  # the case this guards: many tied cuts
    for k in (1, 8, 32):
        assert torch.equal(topk_ids(x, k), _stable_topk(x, k))
    # whole blocks of equal values and -inf ties, walked in narrow column tiles (as the fused
    # head walks them): every tile's cut ambiguous, the exact re-rank in row chunks of 1, 3, 100
    y = torch.randint(0, 3, (40, 50), generator=g).bfloat16()
    y[::3, 10:] = -INF
    for width in (1, 4, 7, 50):
        for chunk in (1, 3, 100):
            assert torch.equal(_select_in_tiles(y, 12, width, chunk), _stable_topk(y, 12)), (width, chunk)
    assert torch.equal(topk_ids(y, 12), _stable_topk(y, 12))
    assert torch.equal(topk_ids(y.double(), 49), _stable_topk(y, 49))  # k = all but one column, fp64
    assert torch.equal(topk_ids(torch.zeros(4, 20, dtype=torch.bfloat16), 6), torch.arange(6).expand(4, 6))
