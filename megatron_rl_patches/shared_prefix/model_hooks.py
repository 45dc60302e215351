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
from __future__ import annotations

from typing import Any

from megatron_rl_patches.model.chunks import modules_of
from megatron_rl_patches.model.kinds import is_language_model
from megatron_rl_patches.shared_prefix.kinds import model_kinds
from megatron_rl_patches.shared_prefix.kinds.attention_layers import note_unknown_core
from megatron_rl_patches.shared_prefix.kinds.language_models import FIRST_CALL, FirstCall
from megatron_rl_patches.shared_prefix.packed_params import FORMAT, params_type, shared_prefix_params
from megatron_rl_patches.shared_prefix.refusals import config_refusal

__all__ = ["FORMAT", "INSTALLED", "params_type", "prepare_shared_prefix", "shared_prefix_params"]

INSTALLED = "_megatron_rl_patches_shared_prefix"  # the mark on a prepared module


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
