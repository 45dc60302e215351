"""The dict an output processor returns, with what megatron-core's schedule reads off a model's
output: `forward_step_calc_loss` (0.13-0.17) reads `output_tensor.device` whenever
`num_moe_experts` or `mtp_num_layers` is set, and a plain dict has none (AttributeError, and
under pipeline parallelism the other stages wait for the crashed one in p2p)."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree
from torch.utils._pytree import MappingKey


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

    def __reduce__(self) -> tuple[Any, ...]:
        # rebuilt from a plain dict: torch.load's weights-only unpickler sets items on dicts only
        return ProcessorOutput, (dict(self),)


def _flatten(output: ProcessorOutput) -> tuple[list[Any], list[Any]]:
    return list(output.values()), list(output.keys())


def _unflatten(values: Any, keys: Any) -> ProcessorOutput:
    return ProcessorOutput(zip(keys, values, strict=True))


def _flatten_with_keys(output: ProcessorOutput) -> tuple[list[tuple[Any, Any]], list[Any]]:
    return [(MappingKey(key), value) for key, value in output.items()], list(output.keys())


def _register() -> None:
    """Treat the output as the dict it is: `torch.load` (weights_only, its default) may rebuild it,
    and torch's pytree (tree_leaves, tree_map) walks into its tensors. Idempotent."""
    add_safe_globals = getattr(torch.serialization, "add_safe_globals", None)
    if add_safe_globals is not None and ProcessorOutput not in torch.serialization.get_safe_globals():
        add_safe_globals([ProcessorOutput])
    if ProcessorOutput not in _pytree.SUPPORTED_NODES:
        _pytree.register_pytree_node(ProcessorOutput, _flatten, _unflatten,
                                     serialized_type_name=f"{__name__}.ProcessorOutput",
                                     flatten_with_keys_fn=_flatten_with_keys)


_register()
