"""topk_ids / lm_head_topk_ids with backend="triton" (one kernel: each tile's k best by value, then
lowest id; the tiles merged in that order) equal a stable float64 sort, ties included, and the
torch tiles; bad rows raise the same error. CUDA when present, else Triton's interpreter."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import triton_kit as kit  # noqa: E402

from megatron_rl_patches import lm_head_topk_ids, topk_ids  # noqa: E402

pytestmark = pytest.mark.triton
kit.require_kernels()


def _stable(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sort(x.double().cpu(), dim=1, descending=True, stable=True).indices[:, :k]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_ties_and_padding_equal_a_stable_sort(dtype):
    """Integer logits: blocks of ties at every cut; -inf runs; vocab_size drops the last columns."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (37, 70), generator=g).to(dtype)
    x[::4, 20:] = -torch.inf
    for k in (1, 5, 17):
        got = topk_ids(x.to(kit.DEVICE), k, backend="triton").cpu()
        assert torch.equal(got, _stable(x, k)), k
        assert torch.equal(got, topk_ids(x, k, backend="torch"))
    assert torch.equal(topk_ids(x.to(kit.DEVICE), 9, vocab_size=60, backend="triton").cpu(), _stable(x[:, :60], 9))


def test_fused_head_equals_the_stable_sort_of_its_logits():
    """Integer-valued h and W (exact logits): the kernel's h·Wᵀ tiles, several vocabulary tiles per row."""
    g = torch.Generator().manual_seed(1)
    h = torch.randint(-2, 3, (21, 16), generator=g).float()
    w = torch.randint(-1, 2, (53, 16), generator=g).float()
    for k in (1, 4, 12):
        got = lm_head_topk_ids(h.to(kit.DEVICE), w.to(kit.DEVICE), k, backend="triton").cpu()
        assert torch.equal(got, _stable(h @ w.T, k)), k
    rows = torch.arange(21) % 3 == 0
    got = lm_head_topk_ids(h.to(kit.DEVICE), w.to(kit.DEVICE), 4, row_mask=rows.to(kit.DEVICE), backend="triton")
    assert torch.equal(got.cpu()[rows], _stable(h @ w.T, 4)[rows]) and bool((got.cpu()[~rows] == 0).all())


def test_bad_rows_raise_as_on_the_torch_tiles():
    x = torch.randn(6, 30)
    x[2, 5] = torch.nan
    with pytest.raises(ValueError, match=r"rows \[2\]") as triton_error:
        topk_ids(x.to(kit.DEVICE), 3, backend="triton")
    with pytest.raises(ValueError) as torch_error:
        topk_ids(x, 3, backend="torch")
    assert str(triton_error.value) == str(torch_error.value)


def test_candidates_are_made_a_launch_at_a_time(monkeypatch):
    """Each launch is whole row blocks times whole vocabulary tiles within the budget; the ids are
    those of one launch over everything (the tiles' values and the exact merge do not depend on
    the cut). Before: one launch of all T rows (8.0 U excess at T = 4096, k = 64 on an H200)."""
    from megatron_rl_patches.ops.kernels.triton import backend, topk_launches

    g = torch.Generator().manual_seed(2)
    h = torch.randint(-2, 3, (100, 16), generator=g).float()
    w = torch.randint(-1, 2, (300, 16), generator=g).float()
    k = 5
    b = backend.blocks(kit.DEVICE, True)
    tile_block = topk_launches.TOPK_BYTES_PER_CANDIDATE * k * b.m
    launches: list[tuple[int, int]] = []
    kernel = backend.topk_tile_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((args[5], args[6]))  # the launch's rows and columns
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(backend, "topk_tile_kernel", Recording())
    for budget, shape in ((tile_block * 3, (b.m, 3 * b.n)), (tile_block * 19 * 2, (2 * b.m, 300))):
        launches.clear()
        monkeypatch.setattr(topk_launches, "topk_budget", lambda *_, budget=budget: budget)
        got = lm_head_topk_ids(h.to(kit.DEVICE), w.to(kit.DEVICE), k, backend="triton").cpu()
        rows = [min(shape[0], 100 - r0) for r0 in range(0, 100, shape[0])]
        cols = [min(shape[1], 300 - c0) for c0 in range(0, 300, shape[1])]
        assert launches == [(r, c) for r in rows for c in cols], budget
        assert torch.equal(got, _stable(h @ w.T, k))
        assert torch.equal(got, lm_head_topk_ids(h, w, k, backend="torch"))


@pytest.mark.parametrize("n_rows", [64, 256])
def test_the_launches_hold_a_small_share_of_u_whatever_t(n_rows):
    """The step's excess (every tensor it makes, counted on CPU) stays within 0.1 U = T·V·4·0.1 and,
    measured in U, does not grow with T. Before: a whole tile budget of candidates (8 MiB on CPU,
    256 MiB on CUDA) whatever T: 0.129 U at T = 8,192, V = 65,536 on an H100; 2.9 U here."""
    from megatron_rl_patches.ops.kernels.sources import Source
    from megatron_rl_patches.ops.kernels.triton import backend
    from megatron_rl_patches.ops.topk_select import RunningTopk

    V, k = 512, 4
    x = torch.randn(n_rows, V, generator=torch.Generator().manual_seed(3)).to(kit.DEVICE)
    run = RunningTopk.empty(n_rows, k, torch.float32, x.device, sentinel=V)
    with kit.LiveBytes(x) as counted:
        got = backend.TritonTiles().topk(Source(V, None, logits=x), run, 0)
    held = got.values.nbytes + got.ids.nbytes + got.row_max.nbytes  # the result
    excess = (counted.peak - held) / (n_rows * V * 4)
    assert excess <= 0.1, f"excess {excess:.3f} U"
    assert torch.equal(got.ids.cpu(), _stable(x, k))
