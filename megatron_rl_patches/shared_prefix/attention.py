"""Attention over a shared-prefix stream: a remainder sees its prefix and itself, nothing of its
siblings; a prefix, a sample alone and padding see themselves, causally.

Two routes over one rule (`SharedPrefixPlan.segments` / `visible`):
- `mask`: each independent block of the plan on its own through torch's scaled dot-product attention:
  a sample alone and padding plainly causal; a group's prefix causal, then each remainder's rows
  against the prefix's keys and its own under its [R, P + R] mask (all of the prefix, itself
  causally), so a group costs P² + Σ R·(P + R) scores, never its siblings' (any device; the route on
  CPU, and with gradients wherever FlexAttention has none).
- `flex`: FlexAttention over the whole stream with a block mask built from the same rule (CUDA,
  forward and backward; on CPU torch runs it without gradients).
Both take megatron-core's core-attention layout (query [s, b, heads, d], key / value [s, b,
groups, d]; [s, heads, d] where megatron-core squeezed the packed batch) and return [s, b, heads * d]
([s, 1, heads * d])."""
from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch
import torch.nn.functional as F

from megatron_rl_patches.shared_prefix.plan import SharedPrefixPlan

ROUTES = ("auto", "mask", "flex")


def check_route(route: Any) -> str:
    if route not in ROUTES:
        raise ValueError(f"shared-prefix attention: route must be one of {', '.join(ROUTES)}, got {route!r}")
    return str(route)


def chosen_route(route: str, query: torch.Tensor) -> str:
    """`auto`: flex on CUDA where torch has FlexAttention (2.5 and later), the mask route elsewhere."""
    if route != "auto":
        return route
    return "flex" if query.is_cuda and importlib.util.find_spec("torch.nn.attention.flex_attention") else "mask"


def _heads_first(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.permute(1, 2, 0, 3)  # [s, b, h, d] -> [b, h, s, d]


def _grouped(key: torch.Tensor, heads: int) -> torch.Tensor:
    """Key / value heads repeated to the query's (grouped-query attention), [b, h, s, d]."""
    groups = key.size(1)
    if groups == heads:
        return key
    if heads % groups:
        raise ValueError(f"shared-prefix attention: {heads} query heads do not split into {groups} key/value groups")
    return key.repeat_interleave(heads // groups, dim=1)


def shared_prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: SharedPrefixPlan, *,
                            scale: float, dropout: float = 0.0, route: str = "auto") -> torch.Tensor:
    """Attention of the plan's physical stream (query / key [s, b, h, d] / [s, b, g, d], value [s, b, g,
    dv]: multi-latent attention's values have a width of their own) -> [s, b, h * dv] in the query's dtype;
    `dropout` on the attention probabilities (0 in evaluation)."""
    if query.dim() == 3:  # megatron-core < 0.16 squeezes the batch of any packed input: [t, h, d]
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
    rows, batch, heads = query.shape[:3]
    if rows != plan.physical_length:
        raise ValueError(f"shared-prefix attention: the query has {rows} rows, the plan's stream "
                         f"{plan.physical_length}")
    q, k, v = _heads_first(query), _heads_first(key), _heads_first(value)
    route = chosen_route(check_route(route), query)
    if route == "flex":
        out = _flex(q, k, v, plan, scale)
    else:
        k, v = _grouped(k, heads), _grouped(v, heads)
        parts = []
        for block in plan.blocks:
            if block.causal:
                part = slice(block.start, block.end)
                parts.append(F.scaled_dot_product_attention(q[:, :, part], k[:, :, part], v[:, :, part],
                                                            dropout_p=dropout, is_causal=True, scale=scale))
                continue
            prefix = slice(block.start, block.start + block.prefix)
            parts.append(F.scaled_dot_product_attention(q[:, :, prefix], k[:, :, prefix], v[:, :, prefix],
                                                        dropout_p=dropout, is_causal=True, scale=scale))
            for first, last in block.rests:
                rest = slice(first, last)
                keys = torch.cat([k[:, :, prefix], k[:, :, rest]], dim=2)
                values = torch.cat([v[:, :, prefix], v[:, :, rest]], dim=2)
                mask = plan.cached(("rest", block.prefix, last - first, str(q.device)),
                                   functools.partial(rest_mask, block.prefix, last - first, q.device))
                parts.append(F.scaled_dot_product_attention(q[:, :, rest], keys, values, attn_mask=mask,
                                                            dropout_p=dropout, scale=scale))
        out = torch.cat(parts, dim=2)
    return out.permute(2, 0, 1, 3).reshape(rows, batch, heads * value.size(-1))  # MLA: values of their own width


@functools.cache
def compiled_flex() -> Any:
    """FlexAttention compiled once per process (its fused kernels; eager FlexAttention materializes the
    scores), for any stream length (each micro-batch's plan has its own)."""
    # lazy: import cost: FlexAttention's module (torch < 2.5 has none; only the flex route needs it)
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def rest_mask(prefix: int, rows: int, device: Any) -> torch.Tensor:
    """[rows, prefix + rows] bool: a remainder's rows see all of its prefix and themselves causally."""
    mask = torch.ones(rows, prefix + rows, dtype=torch.bool, device=device)
    mask[:, prefix:] = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()
    return mask


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SharedPrefixPlan, scale: float) -> torch.Tensor:
    # lazy: import cost: FlexAttention's module (torch < 2.5 has none; only the flex route needs it)
    from torch.nn.attention.flex_attention import flex_attention

    attend = compiled_flex() if q.is_cuda else flex_attention  # on CPU torch runs it eagerly, without gradients
    if q.size(1) % k.size(1):
        raise ValueError(f"shared-prefix attention: {q.size(1)} query heads do not split into {k.size(1)} key/value "
                         "groups")
    return attend(q, k, v, block_mask=flex_block_mask(plan, q.device), scale=scale, enable_gqa=q.size(1) != k.size(1))


def flex_block_mask(plan: SharedPrefixPlan, device: Any) -> Any:
    """FlexAttention's block mask of the plan on `device` (built once per plan and device)."""
    # lazy: import cost: FlexAttention's module (torch < 2.5 has none; only the flex route needs it)
    from torch.nn.attention.flex_attention import create_block_mask

    segments, visible = plan.on(device, "segments"), plan.on(device, "visible")

    def sees(batch: Any, head: Any, row: Any, column: Any) -> Any:
        return (column <= row) & ((segments[column] == segments[row]) | (segments[column] == visible[row]))

    length = plan.physical_length
    return plan.cached(("flex", str(torch.device(device))),
                       lambda: create_block_mask(sees, None, None, length, length, device=str(device)))
