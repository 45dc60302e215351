"""The pieces a model is streamed in, in forward order: the embedding, each decoder layer, and the
head (final norm + output layer, with the tied embedding weight when the output layer shares it).
Parameters outside these pieces stay on the device."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl_patches.model.chunks import unwrap


@dataclass(eq=False)
class Unit:
    """Modules that arrive and leave together, and the parameters they read."""

    name: str
    modules: list[torch.nn.Module]
    params: list[torch.nn.Parameter]
    refs: int = 0  # uses now: holds and forwards (nested and re-entrant ones each count)
    holds: int = 0  # of which hold() / on_device(): while > 0 its forwards do not prefetch
    event: object = None  # pending CUDA copy event
    copies: int = 0
    cached: bool = False  # kept on the device by a budget after its use, evictable
    last_used: int = 0

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)

    @property
    def active(self) -> bool:
        return self.refs > 0


def _unique(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    seen: set[int] = set()
    return [p for p in params if not (id(p) in seen or seen.add(id(p)))]  # type: ignore[func-returns-value]


def _params(*modules: torch.nn.Module | None) -> list[torch.nn.Parameter]:
    return _unique([p for m in modules if m is not None for p in m.parameters()])


def stream_units(chunk: torch.nn.Module, index: int) -> list[Unit]:
    """Units of one model chunk (GPTModel, HybridModel, possibly Float16Module-wrapped; a
    multi-token-prediction block is one unit); a ValueError for a model with no `decoder.layers`."""
    model = unwrap(chunk)
    decoder = getattr(model, "decoder", None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(
            f"residency='stream' streams a model layer by layer and needs a Megatron language model "
            f"with decoder.layers (GPTModel, HybridModel); chunk {index} is a {type(model).__name__}: "
            "use residency='swap' for it"
        )
    prefix = f"chunk{index}." if index else ""
    units: list[Unit] = []
    embedding = getattr(model, "embedding", None)
    if isinstance(embedding, torch.nn.Module) and _params(embedding):
        units.append(Unit(prefix + "embedding", [embedding], _params(embedding)))
    for i, layer in enumerate(layers):
        units.append(Unit(f"{prefix}layer{i}", [layer], _params(layer)))
    norm = getattr(decoder, "final_layernorm", None) or getattr(decoder, "final_norm", None)
    output = getattr(model, "output_layer", None)
    head_modules = [m for m in (norm, output) if isinstance(m, torch.nn.Module)]
    head_params = _params(*head_modules)
    if output is not None and getattr(model, "share_embeddings_and_output_weights", False):
        head_params = _unique(head_params + [model.shared_embedding_or_output_weight()])
    if head_modules:
        units.append(Unit(prefix + "head", head_modules, head_params))
    # multi-token prediction: megatron's forward runs the block after the final norm, before the
    # output layer (the block calls the embedding itself, which its own unit brings in)
    mtp = getattr(model, "mtp", None)
    if isinstance(mtp, torch.nn.Module) and _params(mtp):
        units.append(Unit(prefix + "mtp", [mtp], _params(mtp)))
    return units


def whole_unit(chunk: torch.nn.Module, index: int) -> Unit:
    """One unit holding every parameter of the chunk (swap)."""
    return Unit(f"chunk{index}", [chunk], _params(chunk))
