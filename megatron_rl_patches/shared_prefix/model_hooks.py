"""A megatron-core model that runs a shared-prefix plan: the model above attention and RoPE runs
unchanged; only a few seams take the plan, each from the `packed_seq_params` argument megatron-core
already hands down every call (forward, pipeline stages, recompute), never from module state.

Which seam a module takes is its kind's (`kinds`, one object per model kind):
- the language model: the logical ids a framework passes become the plan's physical ids and each
  token's own position, and the decoder's rows are read back at each logical row on the last
  pipeline stage (`kinds.language_models`; at its first planned call it refuses by name what
  `check_shared_prefix` refuses of its config);
- each attention layer: the rotary table the model built is read at each token's own position
  (`kinds.attention_layers`); multi-latent attention's own rotary table likewise (`mla`);
- each core attention: the package's own (`attention.shared_prefix_attention`), for the plain cores
  the plan knows (Transformer Engine's, megatron-core's local one, the package's and the test kit's):
  the module's class becomes a subclass that takes the plan's route and calls its own class
  otherwise (`kinds.plain_cores`); DSA's core takes the plan's rule as its mask (`sparse_attention`);
- MoE layers in training (`moe_statistics`), the MTP block (`mtp`), megatron-core's gated delta nets
  (`gated_delta_net`), and a framework's own layers through the kind it registers.

Under context parallelism each seam reads its rank's share of the plan (`context_parallel`): the
ids and positions of its physical rows, its attention against every rank's keys and values, its
logical rows read from every rank's output.

`prepare_shared_prefix(model)` installs them once (idempotent); a call without a plan runs exactly
as before. `shared_prefix_params(plan)` is what a caller passes as `packed_seq_params`."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from megatron_rl_patches.model.chunks import modules_of
from megatron_rl_patches.model.kinds import is_language_model
from megatron_rl_patches.shared_prefix.attention import check_route
from megatron_rl_patches.shared_prefix.context_parallel import WholeRotaryTable, check_logical_layout
from megatron_rl_patches.shared_prefix.kinds import model_kinds
from megatron_rl_patches.shared_prefix.kinds.attention_layers import note_unknown_core
from megatron_rl_patches.shared_prefix.kinds.language_models import FIRST_CALL, FirstCall
from megatron_rl_patches.shared_prefix.plan import SharedPrefixPlan
from megatron_rl_patches.shared_prefix.refusals import config_refusal

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


def prepare_shared_prefix(model: Any) -> Any:
    """Install the plan's seams on `model` (a megatron-core model, wrapped or not, or a list of chunks)
    once, each module's by the kinds that recognize it; returns `model`. A call whose
    `packed_seq_params` holds no plan runs as before."""
    found = False
    kinds = model_kinds()
    module: Any
    for module in list(modules_of(model, "prepare_shared_prefix")):
        language_model = is_language_model(module)
        found = found or language_model
        if getattr(module, INSTALLED, False):
            continue
        if language_model:
            setattr(module, FIRST_CALL, FirstCall(config_refusal))
        installed = [kind.prepare(module) for kind in kinds if kind.recognizes(module)]
        if any(installed):
            setattr(module, INSTALLED, True)
    for module in modules_of(model, "prepare_shared_prefix"):
        note_unknown_core(module, kinds)
    if not found:
        raise ValueError("prepare_shared_prefix: no megatron-core language model (GPTModel, HybridModel) in model")
    return model
