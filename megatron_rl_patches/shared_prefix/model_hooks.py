"""A megatron-core model that runs a shared-prefix plan: the model above attention and RoPE runs
unchanged; only five seams take the plan, each from the `packed_seq_params` argument megatron-core
already hands down every call (forward, pipeline stages, recompute), never from module state:

- the language model (GPTModel, HybridModel): the logical ids a framework passes become the plan's
  physical ids and each token's own position (a forward pre-hook; the ids are checked to be the ones
  the plan was built from);
- each attention layer: the rotary table the model built is read at each token's own position (a
  forward pre-hook);
- each core attention: the package's own (`attention.shared_prefix_attention`), whatever core the
  layer spec built (Transformer Engine's, megatron-core's local one, a test kit's stand-in): the
  module's class becomes a subclass that takes the plan's route and calls its own class otherwise;
- the decoder of the last pipeline stage: its physical rows are read back at each logical row (a
  forward hook), so the output layer, an output processor and every framework's loss see the rows
  they see today (the prefix's last row once per member: G targets);
- each of megatron-core's gated delta nets: a remainder continues its prefix's recurrent state and
  convolution window (`gated_delta_net.planned_gated_delta_net_class`); slime's own (Qwen3.5's and
  Qwen3-Next's `HuggingfaceAttention` layers) the same way (`slime_gated_delta_net`). The package's
  own inference gated delta net runs a plan without preparing.

Three kinds of model bring a seam of their own (each in its module): multi-latent attention's own
rotary table (`mla`), an MoE router's statistics in training (`moe_statistics`: the plan handed to
the router for the layer's call only) and the MTP block (`mtp`: each depth a stream of its own plan).

Under context parallelism each seam reads its rank's share of the plan (`context_parallel`): the
ids and positions of its physical rows, its attention against every rank's keys and values, its
logical rows read from every rank's output.

`prepare_shared_prefix(model)` installs them once (idempotent); a call without a plan runs exactly
as before. `shared_prefix_params(plan)` is what a caller passes as `packed_seq_params`."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch

from megatron_rl_patches.model.arguments import ArgumentsByName
from megatron_rl_patches.model.attention_layout import with_batch
from megatron_rl_patches.model.chunks import modules_of
from megatron_rl_patches.model.kinds import is_attention, is_language_model
from megatron_rl_patches.shared_prefix.attention import check_route, shared_prefix_attention
from megatron_rl_patches.shared_prefix.context_parallel import (
    WholeRotaryTable,
    check_logical_layout,
    gathered_stream,
    module_share,
    taken,
)
from megatron_rl_patches.shared_prefix.gated_delta_net import is_gated_delta_net, prepare_gated_delta_net
from megatron_rl_patches.shared_prefix.held import computed, held_rows_of, whole_stream
from megatron_rl_patches.shared_prefix.held_passes import begin_held_pass, deferred_at_input, end_held_pass
from megatron_rl_patches.shared_prefix.mla import is_latent_attention, prepare_latent_attention
from megatron_rl_patches.shared_prefix.moe_statistics import is_moe_layer, prepare_moe_layer
from megatron_rl_patches.shared_prefix.mtp import is_mtp_block, prepare_mtp_block
from megatron_rl_patches.shared_prefix.plan import SharedPrefixPlan, shared_prefix_plan_of
from megatron_rl_patches.shared_prefix.slime_gated_delta_net import (
    is_slime_gated_delta_net,
    prepare_slime_gated_delta_net,
)
from megatron_rl_patches.shared_prefix.sparse_attention import is_sparse_attention, prepare_sparse_attention

FORMAT = "shared_prefix"  # the qkv_format of a plan's params: a core attention not prepared refuses it
INSTALLED = "_megatron_rl_patches_shared_prefix"  # the mark on a prepared module


@functools.cache
def params_type() -> type:
    """megatron-core's `PackedSeqParams` with the plan and its attention route."""
    from megatron.core.packed_seq_params import PackedSeqParams

    @dataclasses.dataclass
    class SharedPrefixParams(PackedSeqParams):
        """The `packed_seq_params` of a micro-batch packed by shared prefix."""

        shared_prefix: Any = None
        route: str = "auto"
        cp_layout: str = "zigzag"
        # an MTP depth's stream (shared_prefix/mtp.py): the main plan its output is read back at
        main_plan: Any = None

    return SharedPrefixParams


def shared_prefix_params(plan: SharedPrefixPlan, route: str = "auto", cp_layout: str = "zigzag") -> Any:
    """What a caller passes as `packed_seq_params` to run `plan` on a prepared model: megatron-core's
    `PackedSeqParams` (qkv_format "shared_prefix", the rotary table's length in max_seqlen) holding the
    plan; `route` the attention's ("auto": FlexAttention on CUDA, the mask route elsewhere). Its
    cu_seqlens span the stream as one sequence: megatron-core 0.13-0.15 read any packed params as
    `thd` (the batch dimension squeezed, RoPE per sequence of cu_seqlens), and one sequence takes the
    table the attention hook already read at each token's position, whole. Under context parallelism
    every rank passes the same plan (of the whole micro-batch) and its own share of the ids, cut in
    `cp_layout` ("zigzag": megatron-core's per sequence; "contiguous": slime's --allgather-cp), and
    gets its logits back at those rows (`context_parallel`)."""
    if not isinstance(plan, SharedPrefixPlan):
        raise TypeError(f"shared_prefix_params: plan must be a SharedPrefixPlan, got {type(plan).__name__}")
    whole = torch.tensor([0, plan.physical_length], dtype=torch.int32)
    # the table also covers the padding as packed (one sequence): an MTP depth's stream runs it so
    longest = max(plan.longest, plan.logical_length - plan.stats.logical_tokens)
    cls = params_type()
    # megatron-core 0.16+ hands the rotary embedding this group: the table stays whole under a plan
    whole_table = {"cp_group": WholeRotaryTable()} if "cp_group" in {f.name for f in dataclasses.fields(cls)} else {}
    return cls(qkv_format=FORMAT, cu_seqlens_q=whole, cu_seqlens_kv=whole, max_seqlen_q=longest,
               max_seqlen_kv=longest, shared_prefix=plan, route=check_route(route),
               cp_layout=check_logical_layout(cp_layout), **whole_table)


# the per-model seams a module of its kind takes (each kind's module prepares it)
SEAMS = ((is_moe_layer, prepare_moe_layer), (is_mtp_block, prepare_mtp_block),
         (is_gated_delta_net, prepare_gated_delta_net), (is_slime_gated_delta_net, prepare_slime_gated_delta_net))


def prepare_shared_prefix(model: Any) -> Any:
    """Install the plan's seams on `model` (a megatron-core model, wrapped or not, or a list of chunks)
    once; returns `model`. A call whose `packed_seq_params` holds no plan runs as before."""
    found = False
    module: Any
    for module in list(modules_of(model, "prepare_shared_prefix")):
        if getattr(module, INSTALLED, False):
            found = found or is_language_model(module)
            continue
        if is_language_model(module):
            module.register_forward_pre_hook(physical_inputs, with_kwargs=True)
            module.decoder.register_forward_pre_hook(deferred_at_input, with_kwargs=True)
            module.decoder.register_forward_hook(logical_rows, with_kwargs=True)
            setattr(module, INSTALLED, True)
            found = True
        elif is_attention(module):
            module.register_forward_pre_hook(rotary_at_positions, with_kwargs=True)
            core: Any = module.core_attention
            if is_sparse_attention(core):  # DSA: megatron-core's own top-k under the plan's rule
                prepare_sparse_attention(core)
            elif not isinstance(core, SharedPrefixCore):
                core.__class__ = shared_prefix_core_class(core.__class__)
            if is_latent_attention(module):
                prepare_latent_attention(module)
            setattr(module, INSTALLED, True)
        else:
            prepare = next((prepare for kind, prepare in SEAMS if kind(module)), None)
            if prepare is not None:
                prepare(module)
                setattr(module, INSTALLED, True)
    if not found:
        raise ValueError("prepare_shared_prefix: no megatron-core language model (GPTModel, HybridModel) in model")
    return model


def physical_inputs(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of the language model: the logical ids -> the plan's physical ids and
    positions (a stage without the embedding takes the previous stage's physical rows as they come)."""
    call = ArgumentsByName.of_forward(module, args, kwargs)
    params = call.get("packed_seq_params")
    plan = shared_prefix_plan_of(params)
    if plan is None:
        return None
    if module.pre_process and call.get("decoder_input") is None:
        ids = call.get("input_ids")
        held = module_share(module, plan, params)
        share = None if held is None else held[0]
        length = plan.logical_length if share is None else int(share.logical.numel())
        if not isinstance(ids, torch.Tensor) or tuple(ids.shape) != (1, length):
            shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            mine = "" if share is None else f" (this context-parallel rank's {params.cp_layout} share of them)"
            raise ValueError(f"shared prefix: input_ids must be the packed ids the plan was built from{mine}, [1, "
                             f"{length}], got {shape}")
        logical = (plan.on(ids.device, "logical_tokens") if share is None
                   else taken(plan, share, "logical_tokens", "logical", ids.device))
        if not torch.equal(ids[0].to(torch.int64), logical):
            raise ValueError("shared prefix: input_ids differ from the ids the plan was built from (build the plan "
                             "from this micro-batch's tokens" + ("" if share is None else ", whole on every context-"
                             f"parallel rank, and pass cp_layout={params.cp_layout!r} only for ids cut that way") + ")")
        vocab = int(module.vocab_size)
        if plan.physical_length and int(plan.tokens.max()) >= vocab:
            raise ValueError(f"shared prefix: token id {int(plan.tokens.max())} is past the model's vocabulary "
                             f"({vocab} ids)")
        if plan.physical_length and int(plan.tokens.min()) < 0:
            raise ValueError(f"shared prefix: token id {int(plan.tokens.min())} is negative: the model's ids are 0 "
                             f"to {vocab - 1}")
        if held_rows_of(plan) is not None:
            begin_held_pass(module, plan, params, run_segments)
        if held_rows_of(plan) is not None and share is None:
            call.set("input_ids", computed(plan, "tokens", ids.device)[None])
            call.set("position_ids", computed(plan, "positions", ids.device)[None])
        elif share is None:
            call.set("input_ids", plan.on(ids.device, "tokens")[None])
            call.set("position_ids", plan.on(ids.device, "positions")[None])
        else:
            call.set("input_ids", taken(plan, share, "tokens", "physical", ids.device)[None])
            call.set("position_ids", taken(plan, share, "positions", "physical", ids.device)[None])
    if call.get("padding_mask") is not None:
        raise ValueError("shared prefix: padding_mask is not taken with a shared-prefix plan (the plan's padding "
                         "rows are its own); pass padding_mask=None")
    return call.done()


def run_segments(model: Any, plan: SharedPrefixPlan, like: Any) -> Any:
    """`model` (a prepared language model) over a plan of a step's segments alone, with the route and
    layout of the pass's params `like`: no logical rows, so nothing past the decoder is computed (its
    output holds no row)."""
    device = next(model.parameters()).device
    return model(torch.empty(1, 0, dtype=torch.int64, device=device), None, None,
                 packed_seq_params=shared_prefix_params(plan, route=like.route, cp_layout=like.cp_layout))


def rotary_at_positions(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of an attention layer: the rotary table at each physical row's position."""
    call = ArgumentsByName.of_forward(module, args, kwargs)
    params = call.get("packed_seq_params")
    plan = shared_prefix_plan_of(params)
    table = call.get("rotary_pos_emb")
    if plan is None or table is None:
        return None
    held = module_share(module, plan, params)

    def at_positions(emb: Any) -> Any:
        if emb is None:
            return None
        if emb.size(0) < plan.longest:
            raise ValueError(f"shared prefix: the model's rotary table has {emb.size(0)} rows, the plan's longest "
                             f"sample {plan.longest}")
        if held is not None:
            return emb.index_select(0, taken(plan, held[0], "positions", "physical", emb.device))
        return emb.index_select(0, computed(plan, "positions", emb.device))

    call.set("rotary_pos_emb", tuple(at_positions(e) for e in table) if isinstance(table, tuple)
             else at_positions(table))
    return call.done()


def logical_rows(module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
    """Forward hook of the decoder: on the last pipeline stage, its physical rows read at each
    logical row (under sequence parallelism: gathered, read, scattered back)."""
    params = kwargs.get("packed_seq_params")
    plan = shared_prefix_plan_of(params)
    if plan is None or not getattr(module, "post_process", True):
        return None
    if not isinstance(output, torch.Tensor):
        raise ValueError(f"shared prefix: the decoder returned {type(output).__name__}, not its hidden states")
    from megatron.core import parallel_state, tensor_parallel

    sequence_parallel = bool(getattr(module.config, "sequence_parallel", False))
    tp = parallel_state.get_tensor_model_parallel_world_size() if sequence_parallel else 1
    hidden = output
    held = module_share(module, plan, params)
    logical = plan.logical_length if held is None else int(held[0].logical.numel())
    if tp > 1:
        if logical % tp:
            raise ValueError(f"shared prefix: under sequence parallelism the packed micro-batch ({logical} tokens"
                             f"{'' if held is None else ' on this context-parallel rank'}) must split evenly over "
                             f"the {tp} tensor-parallel ranks")
        # every rank reads the whole stream: the gradient each gets back is the whole one, so keep a split
        hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
    if held is None:
        whole = whole_stream(plan, hidden, "output", module)  # with the held segments' rows, where a step holds some
        rows = whole.index_select(0, plan.on(hidden.device, "logical_rows"))
    else:  # every rank's physical rows, read at this rank's logical rows
        share, group = held
        whole = whole_stream(plan, gathered_stream(hidden, plan, share, group), "output", module)
        rows = whole.index_select(0, taken(plan, share, "logical_rows", "logical", whole.device))
    end_held_pass(plan)
    if tp > 1:
        rows = tensor_parallel.scatter_to_sequence_parallel_region(rows)
    return rows


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


class SharedPrefixCore:
    """The mark of a core attention whose class `shared_prefix_core_class` made."""


@functools.cache
def shared_prefix_core_class(cls: Any) -> type:
    """`cls` (a core attention class) whose forward takes a plan's route: the package's attention
    over the plan; any other call: `cls.forward` as it is."""

    def forward(self: Any, query: Any, key: Any, value: Any, attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        params: Any = kwargs.get("packed_seq_params")
        plan = shared_prefix_plan_of(params)
        if plan is None:
            return cls.forward(self, query, key, value, attention_mask, *args, **kwargs)
        if kwargs.get("attention_bias") is not None:
            raise ValueError("shared prefix: an attention bias is not taken with a shared-prefix plan")
        config = self.config
        scale = config.softmax_scale if getattr(config, "softmax_scale", None) else 1.0 / math.sqrt(query.size(-1))
        if getattr(config, "multi_latent_attention", False):
            scale = self.softmax_scale  # MLA hands its core its own scale (YaRN's mscale squared in it)
        dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0) if self.training else 0.0
        held = module_share(self, plan, params)
        if held is not None:  # this rank's queries against every rank's keys and values
            share, group = held
            key, value = (gathered_stream(t, plan, share, group) for t in with_batch(key, value))
            query = with_batch(query)[0]
        step = held_rows_of(plan)
        if step is not None:  # a step's held segments: their keys and values put back in the stream
            query, key, value = with_batch(query, key, value)
            key, value = whole_stream(plan, key, "key", self), whole_stream(plan, value, "value", self)
        return shared_prefix_attention(query, key, value, plan, scale=scale, dropout=dropout, route=params.route,
                                       window=layer_window(config, getattr(self, "layer_number", 1)),
                                       sink=attention_sink(self),
                                       share=None if held is None else (held[0].size, held[0].rank),
                                       query_rows=None if step is None or held is not None else step.computed)

    return type(f"SharedPrefix{cls.__name__}", (cls, SharedPrefixCore),
                {"forward": forward, "__module__": cls.__module__, "__doc__": cls.__doc__})
