"""The invariant mode on the Triton backend (CUDA, or CPU under TRITON_INTERPRET=1 on the 3.12
lane): `backend="triton"` runs the invariant kernel (ops/kernels/triton/_invariant.py), not the
torch tiles — within 1e-6 of the torch tiles' values (other bits: Triton's exp and GEMM), exact
against float64 with gradients, a row's bits the same among any rows, packed, masked or split in
micro-batches, even when the kernel's vocabulary split follows the row count (as on a GPU); the
negative controls, the same on every CPU, observe the path: the kernel's launches counted, and no
invariant code in the default route (its bits usually move with the split, but whether they do is a
matter of one CPU's roundings). TP = 2: tests/ops/kernels/test_triton_tp.py.

Under the interpreter the fused head's tile GEMM is numpy's BLAS, whose bits may follow a row's
place in the tile (interpreter_dot.py): the row checks run twice there, with a row-by-row tile
dot (the kernel's own structure, bit for bit on any CPU) and with the interpreter's dot (bit for
bit where a probe finds it keeps rows, else within 1e-6: the BLAS's rounding, not the kernel's)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "kernels"))
import triton_kit as kit  # noqa: E402
from interpreter_dot import dot_keeps_rows, row_by_row_dot, rows_alone  # noqa: E402

from megatron_rl_patches import ops  # noqa: E402
from megatron_rl_patches.testing.invariance import check_rows_invariant, counting_invariant_calls  # noqa: E402

pytestmark = pytest.mark.triton
kit.require_kernels()

T, H, V, K = 12, 32, 160, 3  # the interpreter's cost grows with rows x columns: kept small
DEVICE = kit.DEVICE
# the ops whose logits come from the kernel's tile GEMM (tl.dot); the ids ops take the torch tiles'
TILE_GEMM = {"lm_head_log_probs_and_entropy", "lm_head_topk_logprobs"}


def _inputs(n, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, H, generator=g).to(dtype)
    x = (torch.randn(n, V, generator=g) * 3).to(dtype)
    tokens = torch.randint(0, V, (n,), generator=g)
    ids = torch.argsort(torch.rand(n, V, generator=g), dim=1)[:, :K]
    tau = torch.rand(n, generator=g).add(0.5)
    return tuple(t.to(DEVICE) for t in (h, x, tokens, ids, tau))


def _weight(dtype):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(V, H, generator=g) / H**0.5 * 3).to(dtype).to(DEVICE)


def _calls(weight, backend, invariant=True):
    opts = dict(backend=backend, invariant=invariant)
    return {
        "log_probs_and_entropy": lambda h, x, t, i, tau: ops.log_probs_and_entropy(
            x, t, temperature=tau, with_entropy=True, **opts),
        "topk_logprobs": lambda h, x, t, i, tau: ops.topk_logprobs(x, i, **opts),
        "lm_head_log_probs_and_entropy": lambda h, x, t, i, tau: ops.lm_head_log_probs_and_entropy(
            h, weight, t, temperature=tau, with_entropy=True, **opts),
        "lm_head_topk_logprobs": lambda h, x, t, i, tau: ops.lm_head_topk_logprobs(h, weight, i, **opts),
        "lm_head_topk_ids": lambda h, x, t, i, tau: (ops.lm_head_topk_ids(h, weight, K, **opts),),
    }


@pytest.fixture
def kernel_passes(monkeypatch):
    """The invariant kernel's launches in this test, by pass (so no check passes on a fallback)."""
    from megatron_rl_patches.ops.kernels.triton import invariant_backend

    passes: list[str] = []
    kernel = invariant_backend.invariant_tile_kernel

    class Counted:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                passes.append("sums" if kwargs["SUMS"] else "maxima")
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(invariant_backend, "invariant_tile_kernel", Counted())
    return passes


@pytest.fixture
def row_count_splits(monkeypatch):
    """The kernels' vocabulary splits made to follow the row count, as on a GPU (two waves of its
    SMs over the row blocks); the interpreter's own count is fixed."""
    from megatron_rl_patches.ops.kernels.triton import launch

    def splits(n_rows, n_cols, b, device):
        return max(1, min(math.ceil(n_cols / b.n), 2 + n_rows // 9))

    monkeypatch.setattr(launch, "splits_for", splits)


@pytest.fixture(params=["interpreter's dot", "row-by-row dot"])
def tile_dot_keeps_rows(request, monkeypatch):
    """Whether the tile GEMM in this run keeps a row's bits wherever it sits in the tile: the GPU's
    or the interpreter's own dot (probed at the kernel's fused tile shape), or, where the
    interpreter's does not, a row-by-row dot in its place (True by construction)."""
    from megatron_rl_patches.ops.kernels.triton import launch

    if not launch.INTERPRETED:
        if request.param == "row-by-row dot":
            pytest.skip("compiled kernels: the GPU's tile GEMM is the one checked")
        return True
    b = launch.blocks(DEVICE, fused=True)
    keeps_rows = dot_keeps_rows(b.m, b.n, b.k)
    if request.param == "row-by-row dot":
        if keeps_rows:
            pytest.skip("the interpreter's own dot keeps rows here: checked bit for bit by the other run")
        from triton.runtime.interpreter import InterpreterBuilder

        monkeypatch.setattr(InterpreterBuilder, "create_dot", row_by_row_dot)
        return True
    return keeps_rows


def assert_rows_keep_bits(name, exact, got, want):
    """`got` equal to `want` bit for bit; where the tile GEMM moves a row's bits by its place
    (not `exact`, ops in TILE_GEMM only) within 1e-6 times the larger of 1 and the magnitude."""
    for a, b in zip(got, want, strict=True):
        if exact or name not in TILE_GEMM:
            assert torch.equal(a, b), name
        else:
            err = float((a.double() - b.double()).abs().max())
            assert err <= 1e-6 * max(1.0, float(b.double().abs().max())), (name, err)


def test_the_tile_dot_probe_tells_a_dot_that_moves_rows_by_their_place():
    """The probe behind `tile_dot_keeps_rows`: the row-by-row dot keeps rows; a dot that sums the
    odd rows' products in the other order (as a BLAS kernel's second register block may) does not."""
    import numpy as np

    def odd_rows_reversed(a, b, acc):
        out = np.matmul(a, b, dtype=np.float32)
        out[1::2] = np.matmul(a[1::2, ::-1], b[::-1], dtype=np.float32)
        return out + acc

    assert dot_keeps_rows(16, 16, 16, rows_alone)
    assert not dot_keeps_rows(16, 16, 16, odd_rows_reversed)


def test_the_kernel_runs_within_1e6_of_the_torch_tiles(kernel_passes):
    """fp32 and bf16 logits (exact in fp32), fp32 hidden states: every value within 1e-6 (times the
    larger of 1 and its magnitude) of the torch invariant tiles', not their bits; ids equal."""
    cases = [(torch.float32, name) for name in _calls(None, "torch")] + [(torch.bfloat16, "log_probs_and_entropy"),
                                                                          (torch.bfloat16, "topk_logprobs")]
    for dtype, name in cases:
        weight, inputs = _weight(dtype), _inputs(T, 2, dtype)
        ours, tiles = _calls(weight, "triton")[name](*inputs), _calls(weight, "torch")[name](*inputs)
        for a, b in zip(ours, tiles, strict=True):
            if name.endswith("topk_ids"):
                assert torch.equal(a, b), name
                continue
            err = float((a.double() - b.double()).abs().max())
            assert err <= 1e-6 * max(1.0, float(b.abs().max())), (name, dtype, err)
    # the kernel ran (its launches counted, not told from bits: Triton's exp and the torch tiles'
    # may round alike on some CPU): two passes per statistics call (the ids ops take the torch
    # tiles' fixed GEMM tiles)
    assert len(kernel_passes) == 2 * (len(cases) - 1) and set(kernel_passes) == {"maxima", "sums"}


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_and_gradients_equal_float64(fused, dtype, monkeypatch, kernel_passes):
    """Keep mask, per-row temperature, entropy, a padded vocabulary (V = 72, 61 valid); top-k
    log-probs + tail: the float64 reference, gradients through the Triton backward."""
    monkeypatch.setenv("MEGATRON_RL_PATCHES_INVARIANT", "1")
    x = kit.make_inputs(dtype, T=10, H=24, V=72, n_valid=61, k=3, seed=4)
    common = dict(fused=fused, dtype=dtype, n_valid=61)
    got = kit.log_prob_run(x, backend="triton", entropy=True, masked=True, row_tau=True, **common)
    want = kit.log_prob_run(x, backend=None, entropy=True, masked=True, row_tau=True, **common)
    grad_tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 gradients are rounded to bf16
    kit.assert_close(got[:2], want[:2], ("log_probs", "entropy"), 1e-5)
    kit.assert_close(got[2:], want[2:], ("grad_0", "grad_1"), grad_tol)
    got = kit.topk_run(x, backend="triton", **common)
    want = kit.topk_run(x, backend=None, **common)
    kit.assert_close(got[:2], want[:2], ("log_probs", "tail"), 1e-5)
    kit.assert_close(got[2:], want[2:], ("grad_0", "grad_1"), grad_tol)
    assert kernel_passes.count("sums") == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_among_other_rows_keep_their_bits_in_the_invariant_kernel(dtype, row_count_splits, tile_dot_keeps_rows,
                                                                       kernel_passes):
    """Batch composition with the split following T: the invariant kernel keeps every row's bits
    (bf16: the two statistics ops; the fused ones within 1e-6 where the interpreter's BLAS moves
    a row's bits by its place in the tile). The negative control, on every CPU: each statistics
    op launched the invariant kernel (the ids op: the invariant tiles' top-k), and the default
    Triton route (fp32), whose split merge rescales float sums, runs no invariant code."""
    weight = _weight(dtype)
    watched, others = _inputs(5, 3, dtype), _inputs(12, 4, dtype)
    calls = _calls(weight, "triton")
    names = list(calls) if dtype == torch.float32 else ["log_probs_and_entropy", "lm_head_log_probs_and_entropy"]
    for name in names:
        launched = len(kernel_passes)
        with counting_invariant_calls() as used:
            report = check_rows_invariant(calls[name], watched, others)
        assert used.count > 0 and (name.endswith("topk_ids") or len(kernel_passes) > launched), (name, used)
        if tile_dot_keeps_rows or name not in TILE_GEMM:
            assert report.identical, (name, dtype, report)
        else:
            scale = max(1.0, max(float(v.double().abs().max()) for v in calls[name](*watched)))
            assert max(report.max_abs_diff.values()) <= 1e-6 * scale, (name, dtype, report)
    if dtype == torch.float32:
        launched = len(kernel_passes)
        with counting_invariant_calls() as used:
            for name in ("log_probs_and_entropy", "lm_head_log_probs_and_entropy"):
                check_rows_invariant(_calls(weight, "triton", False)[name], watched, others)
        assert used.count == 0 and len(kernel_passes) == launched, used


def test_packed_masked_and_micro_batch_split_rows_keep_their_bits(row_count_splits, tile_dot_keeps_rows):
    """One packed batch, the same with padding rows masked out (row_mask), and two micro-batches
    (the fused ops within 1e-6 where the interpreter's BLAS moves a row's bits by its place)."""
    weight = _weight(torch.float32)
    h, x, tokens, ids, tau = _inputs(20, 6, torch.float32)
    mask = torch.rand(20, generator=torch.Generator().manual_seed(6)) > 0.4
    calls = {
        "log_probs_and_entropy": lambda rows, **kw: ops.log_probs_and_entropy(
            x[rows], tokens[rows], temperature=tau[rows], with_entropy=True, **kw),
        "lm_head_log_probs_and_entropy": lambda rows, **kw: ops.lm_head_log_probs_and_entropy(
            h[rows], weight, tokens[rows], with_entropy=True, **kw),
        "lm_head_topk_logprobs": lambda rows, **kw: ops.lm_head_topk_logprobs(h[rows], weight, ids[rows], **kw),
    }
    for name, call in calls.items():
        opts = dict(backend="triton", invariant=True)
        packed = call(slice(None), **opts)
        masked = call(slice(None), row_mask=mask.to(DEVICE), **opts)
        split = [call(slice(0, 7), **opts), call(slice(7, 20), **opts)]
        assert_rows_keep_bits(name, tile_dot_keeps_rows, [m[mask] for m in masked], [w[mask] for w in packed])
        assert_rows_keep_bits(name, tile_dot_keeps_rows, [torch.cat([part[j] for part in split])
                                                          for j in range(len(packed))], packed)


def test_the_backend_resolved_for_the_invariant_mode():
    """backend='triton' with invariant=True: the kernel's backend over the Triton gradients; the
    torch backend keeps the torch invariant tiles (on CPU their compiled sums where they build)."""
    from megatron_rl_patches.ops.kernels import resolve_backend
    from megatron_rl_patches.ops.kernels.invariant_tiles import InvariantTiles
    from megatron_rl_patches.ops.kernels.native.backend import InvariantNative
    from megatron_rl_patches.ops.kernels.native.build import native_library
    from megatron_rl_patches.ops.kernels.triton.invariant_backend import InvariantTriton

    ours = resolve_backend("triton", DEVICE, torch.float32, invariant=True)
    assert isinstance(ours, InvariantTriton) and ours.base.name == "triton"
    tiles = resolve_backend("torch", DEVICE, torch.float32, invariant=True)
    native = DEVICE.type == "cpu" and native_library() is not None
    assert type(tiles) is (InvariantNative if native else InvariantTiles) and tiles.base.name == "torch"


def test_the_gpu_bench_rows_of_the_invariant_mode_are_the_ops():
    """`bench gpu`'s invariant rows (Triton kernel, torch tiles) on a tiny shape here: each row is
    its backend's invariant op."""
    from megatron_rl_patches.apps.bench import gpu

    x = gpu.make_inputs(20, 16, 90, str(DEVICE), torch.float32)
    rows = {label: fn for label, fn, _ in gpu.implementations()}
    for label, backend in ((gpu.INVARIANT_TRITON, "triton"), (gpu.INVARIANT_TILES, "torch")):
        got = rows[label](x)
        want = ops.lm_head_log_probs_and_entropy(x.hidden, x.weight, x.tokens, with_entropy=True, backend=backend,
                                                 invariant=True)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), label
    table = gpu.run_token_count(20, 16, 90, 1, str(DEVICE), torch.float32,
                                [r for r in gpu.implementations() if r[0] in (gpu.INVARIANT_TRITON, "ours, triton")])
    assert all(row["time_ms"] > 0 for row in table), table
