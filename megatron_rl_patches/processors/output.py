"""The dict an output processor returns, with what megatron-core's schedule reads off a model's
output: `forward_step_calc_loss` (0.13-0.17) reads `output_tensor.device` whenever
`num_moe_experts` or `mtp_num_layers` is set, and a plain dict has none (AttributeError, and
under pipeline parallelism the other stages wait for the crashed one in p2p)."""
from __future__ import annotations

from typing import Any

import torch


class ProcessorOutput(dict):
    """A processor's {name: tensor or None} with `.device` and `.dtype` of its first tensor."""

    def _first_tensor(self) -> torch.Tensor:
        for value in self.values():
            if isinstance(value, torch.Tensor):
                return value
        raise AttributeError("this processor output holds no tensor, so it has no device or dtype")

    @property
    def device(self) -> Any:
        return self._first_tensor().device

    @property
    def dtype(self) -> Any:
        return self._first_tensor().dtype
