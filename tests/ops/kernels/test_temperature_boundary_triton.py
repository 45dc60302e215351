"""The smallest temperature on the Triton tiles (issue 63 item 3): every op gives the τ → 0 limit at
`smallest_temperature` in both modes, from a float and from a per-token tensor, and the next float
below is refused by name (as test_temperature_boundary.py on the torch tiles). CUDA when present, else
Triton's interpreter."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "checks"))
import triton_kit as kit  # noqa: E402
from test_temperature_boundary import below, calls, check_limit, forms  # noqa: E402

from megatron_rl_patches.ops._checks import smallest_temperature  # noqa: E402

pytestmark = pytest.mark.triton
kit.require_kernels()
DEVICE = str(kit.DEVICE)
VOCAB = 300  # a few tiles of the kernel: its running sums move between them (the interpreter is slow)


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "invariant"])
@pytest.mark.parametrize("form", ["float", "tensor"])
@pytest.mark.parametrize("name", sorted(calls("triton")))
def test_every_op_on_the_triton_tiles_at_the_smallest_temperature_gives_the_limit(name, form, invariant):
    call = calls("triton", DEVICE, VOCAB)[name]
    tau = smallest_temperature(torch.float32)
    check_limit(name, call(forms(tau, DEVICE)[form], invariant))
    with pytest.raises(ValueError, match=r"temperature must be >= "):
        call(forms(below(tau), DEVICE)[form], invariant)
