"""The divergence list is the table's: every name the ops take is a table row, in its order (the
slime settings and `bench distill` read it); the Triton kernels serve exactly the rows listed
beside their `entry_terms`, and a row not listed goes to the torch tiles, never to another row's
branch."""
from __future__ import annotations

import pytest

from megatron_rl_patches.apps.bench.distill import short
from megatron_rl_patches.ops._divergences import DIVERGENCES, TABLE, ResolvedDivergence


def test_the_divergences_are_the_tables_rows_with_distinct_bench_labels():
    assert DIVERGENCES == tuple(TABLE) and "mixed_kl" in DIVERGENCES
    labels = [short(name) for name in DIVERGENCES]
    assert len(set(labels)) == len(labels) and short("skew_forward_kl") == "sfkl" and short("tv") == "tv"


@pytest.mark.triton
def test_the_kernels_serve_exactly_their_listed_rows(monkeypatch):
    pytest.importorskip("triton")
    import torch

    from megatron_rl_patches.ops.kernels.sources import Source
    from megatron_rl_patches.ops.kernels.triton import backend

    assert sorted(backend.KERNEL_DIVERGENCES) == sorted(DIVERGENCES)
    h, w = torch.randn(4, 16), torch.randn(8, 16)
    student, teacher = (Source(8, None, hidden=h, weight=w) for _ in range(2))
    tiles = backend.TritonTiles()
    assert all(tiles.serves_divergence(student, [teacher], ResolvedDivergence.of(name)) for name in DIVERGENCES)
    monkeypatch.setattr(backend, "KERNEL_DIVERGENCES", tuple(n for n in backend.KERNEL_DIVERGENCES if n != "tv"))
    assert not tiles.serves_divergence(student, [teacher], ResolvedDivergence.of("tv"))
    assert tiles.serves_divergence(student, [teacher], ResolvedDivergence.of("jsd"))
