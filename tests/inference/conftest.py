"""Helpers shared by the inference tests."""
from __future__ import annotations

import pytest


def _ddp_anywhere(chunk) -> bool:
    import torch
    from megatron.core.distributed import DistributedDataParallel

    ddp_types = (DistributedDataParallel, torch.nn.parallel.DistributedDataParallel)
    return any(isinstance(m, ddp_types) for m in chunk.modules())


@pytest.fixture
def ddp_anywhere():
    """`ddp_anywhere(chunk) -> bool`: a DDP wrapper (megatron-core's or torch's) anywhere in the chunk."""
    return _ddp_anywhere
