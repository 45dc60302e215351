"""The invariant mode gives the same bits for the same logits whatever their strides: column-major
(``x.t().contiguous().t()``), strided (``wide[:, ::2]``) and row-padded logits against contiguous
ones, at V = 300 and 2000, fp32 and bf16, on the CPU route with the compiled sums and on the torch
tiles. Before, a layout of another column stride left the compiled kernel for the torch tiles'
exponent: the entropy's and log-probs' bits moved (within ~1e-7)."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches import ops
from megatron_rl_patches.settings import NATIVE

T = 33


def layouts(x: torch.Tensor, g: torch.Generator) -> dict[str, torch.Tensor]:
    """The values of x in other memory layouts (the same values, other strides)."""
    wide = torch.randn(x.size(0), 2 * x.size(1), generator=g).to(x.dtype)
    wide[:, ::2] = x
    padded = torch.randn(x.size(0), x.size(1) + 5, generator=g).to(x.dtype)[:, : x.size(1)]
    padded.copy_(x)
    return {"column-major": x.t().contiguous().t(), "strided": wide[:, ::2], "row-padded": padded}


def moved_bits(seed: int, V: int, dtype: torch.dtype) -> list[tuple]:
    """(layout, op, output, |difference|) of every output whose bits a layout moved."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, V, generator=g) * 3).to(dtype)
    tokens = torch.randint(0, V, (T,), generator=g)
    ids = torch.stack([torch.randperm(V, generator=g)[:4] for _ in range(T)])
    tau = torch.rand(T, generator=g) + 0.5
    calls = {
        "log-probs, entropy": lambda y: ops.log_probs_and_entropy(y, tokens, with_entropy=True, invariant=True),
        "at a temperature per row": lambda y: ops.log_probs_and_entropy(y, tokens, temperature=tau,
                                                                       with_entropy=True, invariant=True),
        "top-k log-probs, tail": lambda y: ops.topk_logprobs(y, ids, invariant=True),
    }
    wanted = {name: call(x) for name, call in calls.items()}
    moved = []
    for layout, y in layouts(x, g).items():
        assert torch.equal(y, x) and y.stride() != x.stride()
        for name, call in calls.items():
            for index, (want, got) in enumerate(zip(wanted[name], call(y), strict=True)):
                if not torch.equal(want, got):
                    moved.append((layout, name, index, float((want - got).abs().max())))
    return moved


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [300, 2000])
def test_every_layout_of_the_same_logits_gives_the_same_bits(V, dtype, native, monkeypatch):
    monkeypatch.setenv(NATIVE, native)
    assert [moved for seed in range(3) for moved in moved_bits(seed, V, dtype)] == []
