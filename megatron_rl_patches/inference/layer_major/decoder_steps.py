"""A language model's decoder run one layer at a time through its own forward: the inputs the
model hands its decoder (embedding output, rotary embedding, attention mask, packed_seq_params)
captured from the model's own forward; one layer run by the decoder's forward restricted to that
layer (no final norm); the model's own forward resumed on given hidden states with a decoder of
no layers (its final norm, then the output layer or output_processor). Nothing of GPTModel's or
HybridModel's forward is copied, so what they do between layers (viewless tensors, RNG and
quantization contexts) stays theirs.

Works on modules whose decoder has `layers` and a final norm named `final_layernorm` (megatron-core's
TransformerBlock) or `final_norm` (HybridStack), and calls it with `hidden_states=` as a keyword.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_rl_patches.patching.shadow import shadowed

# the decoder's final norm: TransformerBlock (GPTModel), HybridStack (HybridModel)
FINAL_NORM_NAMES = ("final_layernorm", "final_norm")


class _DecoderReached(Exception):
    """Raised by the stand-in decoder forward: carries the arguments the model called it with."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("decoder reached")
        self.call_args, self.call_kwargs = args, kwargs


# stands in for the final norm while one layer runs (megatron-core 0.19 requires a Module there)
_NO_NORM = torch.nn.Identity()


def capture_decoder_call(decoder: torch.nn.Module, model_call: Callable[[], Any]) -> tuple[tuple, dict]:
    """(args, kwargs) the model's forward (`model_call()`) passes its decoder; the forward stops
    there, so nothing after the embedding runs."""

    def stop_here(*args: Any, **kwargs: Any) -> Any:
        raise _DecoderReached(args, kwargs)

    with shadowed(decoder, forward=stop_here):
        try:
            model_call()
        except _DecoderReached as reached:
            if "hidden_states" not in reached.call_kwargs:
                raise TypeError(
                    f"{type(decoder).__name__} was called without a hidden_states= keyword; layer-major "
                    "scoring supports megatron-core's GPTModel and HybridModel, which pass it by name"
                ) from None
            return reached.call_args, reached.call_kwargs
    raise RuntimeError("the model's forward returned without calling its decoder; cannot score it layer-major")


def run_decoder_layer(
    decoder: torch.nn.Module, index: int, call: tuple[tuple, dict], hidden_states: torch.Tensor
) -> torch.Tensor:
    """Layer `index` of the decoder on `hidden_states`, through the decoder's own forward with the
    captured call's other arguments and without its final norm."""
    args, kwargs = call
    layers: Any = decoder.layers
    restricted: dict[str, Any] = {"layers": torch.nn.ModuleList([layers[index]])}
    restricted.update({name: _NO_NORM for name in FINAL_NORM_NAMES if getattr(decoder, name, None) is not None})
    with shadowed(decoder, **restricted):
        output = decoder(*args, **{**kwargs, "hidden_states": hidden_states})
    if not isinstance(output, torch.Tensor):
        raise TypeError(
            f"{type(decoder).__name__} returned {type(output).__name__}, not the hidden states: layer-major "
            "scoring does not support decoder options that add outputs (e.g. extract_layer_indices)"
        )
    return output


def finish_model_call(
    decoder: torch.nn.Module, model_call: Callable[..., Any], hidden_states: torch.Tensor
) -> Any:
    """The model's forward (`model_call(decoder_input=...)`) on the last layer's `hidden_states`:
    the embedding is skipped (decoder_input is set), the decoder runs with no layers (its final
    norm only), the output layer or processor as usual."""
    with shadowed(decoder, layers=torch.nn.ModuleList()):
        return model_call(decoder_input=hidden_states)
