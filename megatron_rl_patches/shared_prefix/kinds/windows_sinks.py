"""Sliding windows and attention sinks: config features of megatron-core's attention the plan's
core attention reads per layer (no module of their own): a layer's window (`layer_window`: the
earlier positions of the token's own sample it sees) and a core's sink logits (`attention_sink`),
both taken by `attention.shared_prefix_attention` under the plan's rule."""
from __future__ import annotations

from typing import Any

import torch

from megatron_rl_patches.shared_prefix.kinds.fields import checked, only, per_token, rows
from megatron_rl_patches.shared_prefix.kinds.kind import ByCode


def layer_window(config: Any, layer_number: int) -> int | None:
    """The earlier positions a layer's sliding window sees (megatron-core's `window_size[0]` where
    `window_attn_skip_freq` makes the layer a windowed one), or None."""
    window = getattr(config, "window_size", None)
    if not window:
        return None
    skip = getattr(config, "window_attn_skip_freq", None)
    if isinstance(skip, int) and layer_number % skip == 0:
        return None
    if isinstance(skip, (list, tuple)) and not skip[layer_number - 1]:
        return None
    if int(window[1]) > 0:
        raise ValueError(f"shared prefix: window_size={tuple(window)} lets a token see {window[1]} later ones; a "
                         "shared-prefix plan runs causal attention only (window_size=(w, 0))")
    left = int(window[0])
    return None if left < 0 else left  # -1: no limit (Transformer Engine's convention)


def attention_sink(core: Any) -> torch.Tensor | None:
    """The core's sink logits per head (`softmax_offset`: zeros off-by-one, a parameter learnable), or None."""
    kind = getattr(getattr(core, "config", None), "softmax_type", "vanilla")
    if kind == "vanilla":
        return None
    offset = getattr(core, "softmax_offset", None)
    if not isinstance(offset, torch.Tensor):  # a core that keeps its sink elsewhere: never attend without it
        raise ValueError(f"shared prefix: softmax_type={kind!r} but the core attention "
                         f"{type(core).__mro__[1].__name__} holds no softmax_offset tensor the plan can read; "
                         "run this model without a sharing plan")
    return offset


WINDOWS_SINKS = ByCode("windows and sinks", fields=rows({
    "softmax_type": only("vanilla", "off-by-one", "learnable", what="this softmax",
                         why="the package's attention adds megatron-core's sink (softmax_offset) for off-by-one and "
                             "learnable sinks only; use one of them or do not share this model's prefixes"),
    "window_size": checked(
        "None; (w, 0) with w >= 0 or -1: earlier positions of the token's own sample (tested on megatron-core's "
        "local attention)",
        lambda value, s, training: value is None or (isinstance(value, (list, tuple)) and len(value) == 2
                                                     and int(value[1]) == 0 and int(value[0]) >= -1),
        what="a sliding window that sees later tokens",
        why="a causal model's window looks back only; set window_size=(w, 0) or None"),
}, {per_token("which layers take window_size: read per layer by the package's attention"): "window_attn_skip_freq"}))
