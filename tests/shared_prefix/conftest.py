"""The shared-prefix tests run MoE auxiliary losses (and MTP's) backward outside megatron-core's
schedule: megatron-core's `MoEAuxLossAutoScaler` then keeps a class-level 0-d scale of its own making,
which a later schedule's `set_loss_scale` (a [1] tensor, copied in place) cannot take. Each test here
leaves that class state as it found it, so a test module after these in the same worker runs as alone."""
from __future__ import annotations

import sys

import pytest

MOE_UTILS = "megatron.core.transformer.moe.moe_utils"


@pytest.fixture(autouse=True)
def _moe_loss_scale_as_found():
    def scaler():
        module = sys.modules.get(MOE_UTILS)
        return getattr(module, "MoEAuxLossAutoScaler", None) if module is not None else None

    before = scaler()
    kept = before.main_loss_backward_scale if before is not None else None
    yield
    after = scaler()
    if after is not None:
        after.main_loss_backward_scale = kept
