"""Attention over a shared-prefix stream: a segment sees its ancestors and itself, causally, nothing
of its siblings (the rule of `attention_rule`, written once).

Two routes over that rule:
- `mask`: on CPU, the rule's blocks (`attention_rule.pieces`) each through torch's flash attention
  for CPU, where the keys and values lie: each segment against its own keys causally, the rows under
  a segment against its keys wholly (one call for all of them: a prefix's keys are read once, never
  copied per remainder), the blocks merged by their log-sum-exp; backward the same blocks with the
  merged output and log-sum-exp (exact: each block's gradient is the whole softmax's). Grouped
  key/value heads stay grouped (the kernel reads them per group). Autograd keeps the queries, keys,
  values, output and log-sum-exp, as one attention over the stream would. Elsewhere (another device,
  dropout on the probabilities) each subtree under the root through torch's scaled dot-product
  attention with the rule as its mask.
- `flex`: FlexAttention over the whole stream with the rule as its mask function (CUDA, forward and
  backward; on CPU torch runs it without gradients).
Under context parallelism (`share`) the query holds one rank's rows of the stream and the keys and
values the whole stream: the same routes read at those rows (`context_parallel.pieces_of_rows`).
Both take megatron-core's core-attention layout (query [s, b, heads, d], key / value [s, b,
groups, d]; [s, heads, d] where megatron-core squeezed the packed batch) and return [s, b, heads * d]
([s, 1, heads * d])."""
from __future__ import annotations

import functools
import importlib.util
import math
from typing import Any

import torch
import torch.nn.functional as F

from megatron_rl_patches.model.attention_layout import heads_first, kv_heads_repeated, sequence_first, with_batch
from megatron_rl_patches.shared_prefix.attention_rule import Block, dense, pieces, sees
from megatron_rl_patches.shared_prefix.context_parallel import physical_share, pieces_of_rows
from megatron_rl_patches.shared_prefix.plan import SharedPrefixPlan

ROUTES = ("auto", "mask", "flex")
WHO = "shared-prefix attention"  # what its errors are named by


def check_route(route: Any) -> str:
    if route not in ROUTES:
        raise ValueError(f"shared-prefix attention: route must be one of {', '.join(ROUTES)}, got {route!r}")
    return str(route)


def chosen_route(route: str, query: torch.Tensor) -> str:
    """`auto`: flex on CUDA where torch has FlexAttention (2.5 and later), the mask route elsewhere."""
    if route != "auto":
        return route
    return "flex" if query.is_cuda and importlib.util.find_spec("torch.nn.attention.flex_attention") else "mask"


def shared_prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: SharedPrefixPlan, *,
                            scale: float, dropout: float = 0.0, route: str = "auto", window: int | None = None,
                            sink: torch.Tensor | None = None, share: tuple[int, int] | None = None,
                            query_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the plan's physical stream (query [s, b, h, d], key / value [s, b, g, d]) ->
    [s, b, h * d] in the query's dtype; `dropout` on the attention probabilities (0 in evaluation);
    `window`: a sliding window of that many earlier positions (each token's own) besides its own;
    `sink` [h]: a logit per head added to every row's softmax with no value (megatron-core's
    `softmax_offset`: zeros for off-by-one, a parameter for a learnable sink, which gets its gradient);
    `share` (context-parallel size, rank): the query holds that rank's rows of the stream
    (`context_parallel.physical_share`), key / value the whole stream; `query_rows` (ascending rows of
    the stream): the query holds those rows (a step's held segments hold the others), key / value the
    whole stream."""
    query, key, value = with_batch(query, key, value)  # megatron-core < 0.16 squeezes a packed batch
    rows, batch, heads = query.shape[:3]
    width = value.size(-1)  # multi-latent attention's values have a width of their own
    if share is not None and query_rows is not None:
        raise ValueError("shared-prefix attention: pass share or query_rows, not both")
    held = query_rows if share is None else physical_share(plan, *share)
    if (rows if held is None else key.size(0)) != plan.physical_length or (held is not None and rows != held.numel()):
        raise ValueError(f"shared-prefix attention: the query has {rows} rows and the keys {key.size(0)}, the plan's "
                         f"stream {plan.physical_length}" + ("" if held is None else f" ({held.numel()} of them this "
                                                                                    "context-parallel rank's)"))
    if heads % key.size(2):
        raise ValueError(f"shared-prefix attention: {heads} query heads do not split into {key.size(2)} key/value "
                         "groups")
    if sink is not None and tuple(sink.shape) != (heads,):
        raise ValueError(f"shared-prefix attention: the sink must hold one logit per query head ({heads}), got "
                         f"{tuple(sink.shape)}")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 0):
        raise ValueError(f"shared-prefix attention: window must be an int >= 0 (earlier positions seen), got "
                         f"{window!r}")
    route = check_route(route)
    if route == "flex" and sink is not None:
        raise ValueError("shared-prefix attention: the flex route takes no attention sink; use route='auto' (the "
                         "rule's mask with the sink as a column) or 'mask'")
    route = "mask" if route == "auto" and sink is not None else chosen_route(route, query)
    if route == "flex":
        q, k, v = heads_first(query, key, value)
        return sequence_first(_flex(q, k, v, plan, scale, window, share, query_rows))
    if not rows:
        return query.new_zeros(0, batch, heads * width)
    if query.device.type == "cpu" and dropout == 0.0:
        blocks = plan.cached(("pieces", window, share, query_rows is not None),
                             lambda: rule_pieces(plan, window) if held is None
                             else pieces_of_rows(rule_pieces(plan, window), held))
        offset = sink if sink is not None else query.new_zeros(0)
        return _widths_matched(query, key, value, offset, blocks, scale).reshape(rows, batch, heads * width)
    if held is not None:
        return share_masked_attention(query, key, value, plan, held, scale, dropout, window, sink).reshape(
            rows, batch, heads * width)
    return rule_masked_attention(query, key, value, plan, scale, dropout, window, sink).reshape(rows, batch,
                                                                                             heads * width)


def _widths_matched(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sink: torch.Tensor,
                    blocks: tuple[Block, ...], scale: float) -> torch.Tensor:
    """`BlockAttention` where CPU flash attention takes one head width for queries, keys and values:
    values narrower than the queries (multi-latent attention) padded with zero columns, cut off after
    (the scores do not change, the padded columns' output is zero): [s, b, h, dv]."""
    extra = query.size(-1) - value.size(-1)
    if extra < 0:
        raise ValueError(f"shared-prefix attention: values wider ({value.size(-1)}) than queries and keys "
                         f"({query.size(-1)}) are not taken")
    padded = F.pad(value, (0, extra)) if extra else value
    out = BlockAttention.apply(query, key, padded, sink, blocks, scale)
    return out[..., :value.size(-1)] if extra else out


def rule_pieces(plan: SharedPrefixPlan, window: int | None = None) -> tuple[Block, ...]:
    """The plan's blocks under the one rule."""
    reach = plan.reach[plan.segment_starts] if plan.physical_length else plan.reach
    return pieces(plan.segment_starts, plan.segment_ends, reach, plan.positions, window)


def rule_masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: SharedPrefixPlan,
                          scale: float, dropout: float, window: int | None = None,
                          sink: torch.Tensor | None = None) -> torch.Tensor:
    """Each subtree under the root through scaled dot-product attention under the rule's mask (a
    sink as one more key of score 0, its logit in the mask, its value 0): [s, b, h, d]."""
    q, k, v = heads_first(query, key, value)
    k, v = kv_heads_repeated(k, q.size(1), WHO), kv_heads_repeated(v, q.size(1), WHO)
    reach, positions = plan.on(q.device, "reach"), plan.on(q.device, "positions")
    tops = (plan.segment_parents < 0).nonzero().flatten().tolist()
    parts = [q[:, :, :0]]
    for segment in tops:
        start = int(plan.segment_starts[segment])
        end = int(plan.reach[start])
        part = slice(start, end)
        mask = plan.cached(("dense", start, window, str(q.device)),
                           functools.partial(dense, end, reach, start, end, positions, window))
        keys, values = k[:, :, part], v[:, :, part]
        if sink is not None:
            logits = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, -math.inf)
            column = sink.to(q.dtype).view(1, -1, 1, 1).expand(q.size(0), -1, end - start, 1)
            mask = torch.cat([logits.expand(q.size(0), q.size(1), -1, -1), column], dim=-1)
            keys = torch.cat([keys, keys.new_zeros(*keys.shape[:2], 1, keys.size(-1))], dim=2)
            values = torch.cat([values, values.new_zeros(*values.shape[:2], 1, values.size(-1))], dim=2)
        parts.append(F.scaled_dot_product_attention(q[:, :, part], keys, values, attn_mask=mask, dropout_p=dropout,
                                                    scale=scale))
    return torch.cat(parts, dim=2).permute(2, 0, 1, 3)


def share_masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: SharedPrefixPlan,
                           share: tuple[int, int] | torch.Tensor, scale: float, dropout: float,
                           window: int | None = None, sink: torch.Tensor | None = None) -> torch.Tensor:
    """A context-parallel rank's query rows (`share`: (size, rank)), or the rows a step computes
    (`share`: those rows), against the whole stream through scaled dot-product attention under the
    rule's mask (a sink as in `rule_masked_attention`): [s_local, b, h, d]."""
    held = share if isinstance(share, torch.Tensor) else physical_share(plan, *share)
    q, k, v = heads_first(query, key, value)
    k, v = kv_heads_repeated(k, q.size(1), WHO), kv_heads_repeated(v, q.size(1), WHO)

    def build() -> torch.Tensor:
        rows = held.to(q.device)
        columns = torch.arange(plan.physical_length, device=q.device)
        return sees(rows[:, None], columns[None, :], plan.on(q.device, "reach"), plan.on(q.device, "positions"),
                    window)

    mask = plan.cached(("share-dense", held.numel(), int(held[0]) if held.numel() else -1, window, str(q.device)),
                       build)
    if sink is not None:
        logits = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, -math.inf)
        column = sink.to(q.dtype).view(1, -1, 1, 1).expand(q.size(0), -1, mask.size(0), 1)
        mask = torch.cat([logits.expand(q.size(0), q.size(1), -1, -1), column], dim=-1)
        k = torch.cat([k, k.new_zeros(*k.shape[:2], 1, k.size(-1))], dim=2)
        v = torch.cat([v, v.new_zeros(*v.shape[:2], 1, v.size(-1))], dim=2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)
    return out.permute(2, 0, 1, 3)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
           mask: torch.Tensor | None = None) -> tuple[Any, Any]:
    """torch's flash attention for CPU of [s, b, h, d] rows: (output [b, h, s, d], log-sum-exp [b, h, s])."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *heads_first(q, k, v), 0.0, causal, attn_mask=mask, scale=scale)


def _logits(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A block's bool mask as the additive logits the kernel takes."""
    return None if mask is None else torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, -math.inf)


class BlockAttention(torch.autograd.Function):
    """The rule's blocks on CPU, merged by their log-sum-exp (see the module), a sink last."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sink: torch.Tensor,
                blocks: tuple[Block, ...], scale: float) -> torch.Tensor:
        rows, batch, heads = query.shape[:3]
        low = query.dtype in (torch.float16, torch.bfloat16)
        acc = torch.float32 if low else query.dtype
        out = torch.empty(rows, batch, heads, value.size(-1), dtype=acc)
        lse = torch.empty(batch, heads, rows, dtype=acc)
        (merged,) = heads_first(out)
        for block in blocks:
            (first, last), (start, end) = block.rows, block.keys
            o, m = _flash(query[first:last], key[start:end], value[start:end], block.causal, scale,
                          _logits(block.mask, query.dtype))
            if block.own:  # every row's own segment first: each row's log-sum-exp finite
                merged[:, :, first:last] = o
                lse[:, :, first:last] = m
                continue
            if block.mask is not None:  # rows the window leaves nothing of this block: no weight
                m = m.masked_fill(~block.mask.any(1), -math.inf)
            before = lse[:, :, first:last]
            total = torch.logaddexp(before, m.to(acc))
            here = merged[:, :, first:last]
            here.mul_((before - total).exp_().unsqueeze(-1)).add_(o.to(acc) * (m - total).exp().unsqueeze(-1))
            lse[:, :, first:last] = total
        if sink.numel():
            total = torch.logaddexp(lse, sink.to(acc).view(1, -1, 1))
            merged.mul_((lse - total).exp_().unsqueeze(-1))
            lse = total
        result = out.to(query.dtype) if low else out
        ctx.save_for_backward(query, key, value, sink, result, lse)
        ctx.blocks, ctx.scale = blocks, scale
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        query, key, value, sink, out, lse = ctx.saved_tensors
        blocks, scale = ctx.blocks, ctx.scale
        low = query.dtype in (torch.float16, torch.bfloat16)
        acc = torch.float32 if low else query.dtype
        grads = [torch.zeros(t.shape, dtype=acc) for t in (query, key, value)]
        gq, gk, gv = heads_first(*grads)
        q, k, v, o, d = heads_first(query, key, value, out, grad.to(query.dtype))
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        for block in blocks:
            rows, keys = slice(*block.rows), slice(*block.keys)
            dq, dk, dv = backward(d[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], o[:, :, rows],
                                  lse[:, :, rows].contiguous(), 0.0, block.causal,
                                  attn_mask=_logits(block.mask, query.dtype), scale=scale)
            gq[:, :, rows] += dq
            gk[:, :, keys] += dk
            gv[:, :, keys] += dv
        grad_sink = None
        if sink.numel() and ctx.needs_input_grad[3]:
            # the sink's column: probability exp(sink - lse), value 0: d sink = -sum p * (dO . O)
            weight = (sink.to(acc).view(1, -1, 1) - lse).exp()
            grad_sink = -(weight * (d.to(acc) * o.to(acc)).sum(-1)).sum((0, 2)).to(sink.dtype)
        if low:
            grads = [g.to(query.dtype) for g in grads]
        return grads[0], grads[1], grads[2], grad_sink, None, None


@functools.cache
def compiled_flex() -> Any:
    """FlexAttention compiled once per process (its fused kernels; eager FlexAttention materializes the
    scores), for any stream length (each micro-batch's plan has its own)."""
    # lazy: import cost: FlexAttention's module (torch < 2.5 has none; only the flex route needs it)
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SharedPrefixPlan, scale: float,
          window: int | None = None, share: tuple[int, int] | None = None,
          query_rows: torch.Tensor | None = None) -> torch.Tensor:
    # lazy: import cost: FlexAttention's module (torch < 2.5 has none; only the flex route needs it)
    from torch.nn.attention.flex_attention import flex_attention

    attend = compiled_flex() if q.is_cuda else flex_attention  # on CPU torch runs it eagerly, without gradients
    return attend(q, k, v, block_mask=flex_block_mask(plan, q.device, window, share, query_rows), scale=scale,
                  enable_gqa=q.size(1) != k.size(1))


def flex_block_mask(plan: SharedPrefixPlan, device: Any, window: int | None = None,
                    share: tuple[int, int] | None = None, query_rows: torch.Tensor | None = None) -> Any:
    """FlexAttention's block mask of the plan on `device` (built once per plan and device); `share`:
    a context-parallel rank's query rows against the whole stream; `query_rows`: those rows."""
    # lazy: import cost: FlexAttention's module (torch < 2.5 has none; only the flex route needs it)
    from torch.nn.attention.flex_attention import create_block_mask

    reach, positions = plan.on(device, "reach"), plan.on(device, "positions")
    rows = physical_share(plan, *share) if share is not None else query_rows
    held = None if rows is None else rows.to(device)

    def mask(batch: Any, head: Any, row: Any, column: Any) -> Any:
        return sees(row if held is None else held[row], column, reach, positions, window)

    length = plan.physical_length
    queries = length if held is None else int(held.numel())
    return plan.cached(("flex", window, share, query_rows is not None, str(torch.device(device))),
                       lambda: create_block_mask(mask, None, None, queries, length, device=str(device)))
