"""The invariant mode on the Triton backend (CUDA, or CPU under TRITON_INTERPRET=1 on the 3.12
lane): `backend="triton"` and `backend="auto"` give the torch backend's invariant bits for every
vocabulary op, among other rows too; in the default mode the Triton kernels' own order shows (the
negative control: these checks compare values that can differ)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "kernels"))
from triton_kit import DEVICE, require_kernels  # noqa: E402

from megatron_rl_patches import ops  # noqa: E402
from megatron_rl_patches.testing.invariance import check_rows_invariant  # noqa: E402

pytestmark = pytest.mark.triton
require_kernels()

T, H, V, K = 12, 32, 600, 3


def _inputs(n, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, H, generator=g).to(dtype)
    x = (torch.randn(n, V, generator=g) * 3).to(dtype)
    tokens = torch.randint(0, V, (n,), generator=g)
    ids = torch.argsort(torch.rand(n, V, generator=g), dim=1)[:, :K]
    return tuple(t.to(DEVICE) for t in (h, x, tokens, ids))


def _weight(dtype):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(V, H, generator=g) / H**0.5 * 3).to(dtype).to(DEVICE)


def _calls(weight, backend, invariant=True):
    opts = dict(backend=backend, invariant=invariant)
    return {
        "log_probs_and_entropy": lambda h, x, t, i: ops.log_probs_and_entropy(x, t, with_entropy=True, **opts),
        "topk_logprobs": lambda h, x, t, i: ops.topk_logprobs(x, i, **opts),
        "lm_head_log_probs_and_entropy": lambda h, x, t, i: ops.lm_head_log_probs_and_entropy(
            h, weight, t, with_entropy=True, **opts),
        "lm_head_topk_logprobs": lambda h, x, t, i: ops.lm_head_topk_logprobs(h, weight, i, **opts),
        "lm_head_topk_ids": lambda h, x, t, i: (ops.lm_head_topk_ids(h, weight, K, **opts),),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_every_backend_gives_the_torch_invariant_bits(backend, dtype):
    weight, inputs = _weight(dtype), _inputs(T, 2, dtype)
    torch_calls, calls = _calls(weight, "torch"), _calls(weight, backend)
    for name, call in calls.items():
        for ours, reference in zip(call(*inputs), torch_calls[name](*inputs)):
            assert torch.equal(ours, reference), (name, backend, dtype)


def test_triton_rows_among_other_rows_keep_their_bits():
    weight = _weight(torch.float32)
    watched, others = _inputs(5, 3, torch.float32), _inputs(40, 4, torch.float32)
    for name, call in _calls(weight, "triton").items():
        report = check_rows_invariant(call, watched, others)
        assert report.identical, (name, report)


def test_the_default_triton_route_is_not_the_invariant_one():
    """The negative control: the Triton kernels' default order gives other bits than the invariant
    route on these inputs (so the comparison above can fail)."""
    weight, inputs = _weight(torch.float32), _inputs(T, 2, torch.float32)
    default, invariant = _calls(weight, "triton", False), _calls(weight, "triton", True)
    differ = [name for name in ("log_probs_and_entropy", "lm_head_log_probs_and_entropy")
              if not all(torch.equal(a, b) for a, b in zip(default[name](*inputs), invariant[name](*inputs)))]
    assert differ, "the Triton default mode matched the invariant route bit for bit on every op"
