"""megatron-core's core-attention layout and torch SDPA's, one adapter for every core the package
runs (the inference SDPA core, the shared-prefix attention, the test kit's packed core):

- megatron hands a core attention query [s, b, heads, d] and key / value [s, b, groups, d]
  ([s, heads, d] where megatron-core < 0.16 squeezed the batch of a packed input: `with_batch`),
  and takes back [s, b, heads * d];
- torch's `scaled_dot_product_attention` (and FlexAttention) take [b, heads, s, d] (`heads_first`),
  key / value heads repeated to the query's for grouped-query attention (`kv_heads_repeated`), and
  the output goes back with `sequence_first`."""
from __future__ import annotations

import torch


def with_batch(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[s, b, h, d] as given; [t, h, d] (a packed input whose batch of one megatron-core squeezed) ->
    [t, 1, h, d]."""
    return tuple(t.unsqueeze(1) if t.dim() == 3 else t for t in tensors)


def heads_first(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[s, b, h, d] -> [b, h, s, d] (views)."""
    return tuple(t.permute(1, 2, 0, 3) for t in tensors)


def kv_heads_repeated(key: torch.Tensor, heads: int, who: str) -> torch.Tensor:
    """Key or value [b, groups, s, d] with each group repeated to `heads` query heads (grouped-query
    attention), [b, heads, s, d]; as given where groups == heads. ValueError naming `who` where the
    query heads do not split into the groups."""
    groups = key.size(1)
    if groups == heads:
        return key
    if heads % groups:
        raise ValueError(f"{who}: {heads} query heads do not split into {groups} key/value groups")
    return key.repeat_interleave(heads // groups, dim=1)


def sequence_first(out: torch.Tensor) -> torch.Tensor:
    """Attention output [b, h, s, d] -> megatron's [s, b, h * d]."""
    batch, heads, rows, width = out.shape
    return out.permute(2, 0, 1, 3).reshape(rows, batch, heads * width)
