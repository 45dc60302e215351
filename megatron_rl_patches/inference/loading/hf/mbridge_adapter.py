"""mbridge 0.15.1 as an optional converter (`converter="mbridge"`): its config mapping and its
`load_weights`, behind small adapters that make it work on CPU and on megatron-core's local spec
(docs/compatibility.md, "Hugging Face checkpoints", lists each one):

- the config comes from config.json's dict through transformers' config class, never a hub id;
- transformers 5 moved `rope_theta` into `rope_parameters`: copied back where mbridge reads it;
- mbridge's TransformerConfig is rebuilt with the CPU settings (no forced sequence parallelism,
  CPU initialization, no fusions, no grouped GEMM) and the caller's dtype (mbridge: bf16);
- the model is the package's own local-spec build (mbridge's builder hard-wires Transformer
  Engine and `.cuda()`);
- mbridge's `load_weights` knows Transformer Engine names: the local spec's norm names and
  SequentialMLP expert names are renamed to them before its mapping runs;
- the checkpoint path it resolves with `cached_file` (a hub lookup) is the checked directory.
"""
from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import torch

from megatron_rl_patches.inference.loading.errors import copying_into_model
from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture, UnsupportedCheckpointError
from megatron_rl_patches.inference.loading.hf.extras import install_hint
from megatron_rl_patches.inference.loading.hf.families import FAMILIES
from megatron_rl_patches.inference.loading.hf.families.kv_heads import kv_repeat
from megatron_rl_patches.inference.loading.hf.model import local_spec_fields
from megatron_rl_patches.inference.residency.placement import weights_on_host
from megatron_rl_patches.model.chunks import unwrap

EXTRA = install_hint("mbridge", "mbridge==0.15.1 einops 'transformers>=5,<6'")
# the families whose mbridge bridge maps onto the local-spec build of this package
SERVED = tuple(sorted(model_type for family in FAMILIES if family.mbridge for model_type in family.model_types))

# local spec name -> Transformer Engine name (the norms are fused into the linears there; a MoE
# layer keeps its pre-MLP norm apart, under the local name mbridge's MoE mapping knows)
_ATTENTION_NORM = (".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
_DENSE_MLP_NORM = (".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def import_mbridge() -> Any:
    """mbridge's AutoBridge, or an ImportError naming the extra."""
    try:
        from mbridge import AutoBridge  # lazy: optional dependency mbridge
    except ImportError as exc:
        raise ImportError(f"converter='mbridge' needs mbridge 0.15.1 ({exc}): {EXTRA}, "
                          "or use converter='builtin'") from exc
    return AutoBridge


def _hf_config(config: dict[str, Any], arch: HFArchitecture) -> Any:
    """transformers' config object of the checkpoint, made from the dict already read (no lookup),
    with the fields mbridge reads under their transformers 4 names."""
    from transformers import AutoConfig  # lazy: optional dependency transformers

    # partial_rotary_factor, which the families mbridge serves ignore (arch.rope.partial is 1), never reaches it
    values = {k: v for k, v in config.items() if k not in ("model_type", "partial_rotary_factor")}
    if isinstance(values.get("rope_parameters"), dict):
        values["rope_parameters"] = {k: v for k, v in values["rope_parameters"].items() if k != "partial_rotary_factor"}
    hf_config = AutoConfig.for_model(arch.model_type, **values)
    hf_config.rope_theta = arch.rope_theta  # transformers 5: rope_parameters["rope_theta"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5: rope_scaling is rope_parameters
        if getattr(hf_config, "rope_scaling", None) is not None:
            # mbridge_bridge refuses every RoPE but the plain one, and mbridge's llama mapping reads
            # rope_scaling["factor"] of any rope_scaling (transformers 5: rope_parameters, no factor)
            hf_config.rope_scaling = None
    return hf_config


def cpu_overrides(dtype: torch.dtype, arch: HFArchitecture) -> dict[str, Any]:
    """TransformerConfig fields mbridge sets for GPUs with Transformer Engine, set for the local spec on CPU."""
    values: dict[str, Any] = dict(
        **local_spec_fields(dtype), bias_dropout_fusion=False, overlap_p2p_comm=False,
        variable_seq_lengths=False,  # the allgather dispatcher (CPU, gloo) refuses it
    )
    if arch.is_moe:
        values.update(
            moe_grouped_gemm=False,
            # mbridge's qwen3_moe sets pre_softmax=False whatever norm_topk_prob says
            moe_router_pre_softmax=not arch.norm_topk_prob,
            moe_token_dispatcher_type="alltoall" if torch.cuda.is_available() else "allgather",
            moe_aux_loss_coeff=0.0, moe_router_bias_update_rate=0.0,
        )
    return values


def mbridge_bridge(config: dict[str, Any], arch: HFArchitecture, dtype: torch.dtype, padded_vocab: int) -> Any:
    """mbridge's bridge of the checkpoint at the parallel sizes of megatron.core.parallel_state,
    its TransformerConfig adapted to the local spec on CPU (`.config`)."""
    auto_bridge = import_mbridge()
    if arch.model_type not in SERVED or arch.model_type not in auto_bridge.list_supported_models():
        raise UnsupportedCheckpointError(
            f"{arch.source}: model_type {arch.model_type!r} is not served by converter='mbridge' (it maps "
            f"{', '.join(SERVED)} onto the local spec); use converter='builtin' or build_inference_model"
        )
    if arch.rope.kind != "default" or arch.rope.partial != 1.0:
        raise UnsupportedCheckpointError(
            f"{arch.source}: RoPE {arch.rope.kind!r} (partial_rotary_factor={arch.rope.partial}) is not served by "
            "converter='mbridge' (mbridge 0.15.1 maps llama3 scaling to a linear interpolation and drops "
            "transformers 5's rope_parameters); use converter='builtin'"
        )
    from megatron.core import parallel_state as ps  # lazy: optional dependency megatron-core

    tp = ps.get_tensor_model_parallel_world_size()
    if kv_repeat(arch, tp) > 1:  # mbridge builds and loads the checkpoint's own query groups
        raise UnsupportedCheckpointError(
            f"{arch.source}: num_key_value_heads={arch.num_kv_heads} at the tensor-parallel size {tp} is served by "
            "repeating the heads, which converter='mbridge' does not do; use converter='builtin'"
        )
    bridge = auto_bridge.from_config(_hf_config(config, arch), dtype=dtype,
                                     make_vocab_size_divisible_by=padded_vocab)
    bridge.set_extra_args(**cpu_overrides(dtype, arch))
    # mbridge pads the vocab to a multiple of this: the package's padded size itself
    bridge.vocab_size, bridge.padded_vocab_size = arch.vocab_size, padded_vocab
    ep_offset = 0
    if arch.is_moe:
        per_rank = arch.num_experts // ps.get_expert_model_parallel_world_size()
        ep_offset = ps.get_expert_model_parallel_rank() * per_rank
    _adapt_names(bridge, ep_offset, arch.is_moe)
    return bridge


def gpt_args(bridge: Any) -> dict[str, Any]:
    """mbridge's GPTModel keywords (RoPE base, length) without its vocab (the package pads it)."""
    values = dict(bridge._get_gptmodel_args())
    for key in ("vocab_size", "position_embedding_type"):
        values.pop(key, None)
    return values


def te_name(name: str, ep_offset: int, moe: bool) -> str:
    """The Transformer Engine name mbridge maps, of a local-spec parameter's global name."""
    for local, te in (_ATTENTION_NORM,) if moe else (_ATTENTION_NORM, _DENSE_MLP_NORM):
        if name.endswith(local):
            return name[: -len(local)] + te
    match = _LOCAL_EXPERT.search(name)
    if match:
        expert, linear = int(match.group(1)) + ep_offset, match.group(2)
        return name[: match.start()] + f".mlp.experts.{linear}.weight{expert}"
    return name


def _adapt_names(bridge: Any, ep_offset: int, moe: bool) -> None:
    """The bridge's local -> global name map, renamed to the names its mapping knows (the local
    experts offset by this rank's first expert: mbridge offsets only grouped-GEMM names)."""
    local_to_global = bridge._weight_name_mapping_mcore_local_to_global

    def renamed(model: torch.nn.Module, consider_ep: bool = True) -> dict[str, str]:
        return {local: te_name(name, ep_offset if consider_ep else 0, moe)
                for local, name in local_to_global(model, consider_ep=consider_ep).items()}

    bridge._weight_name_mapping_mcore_local_to_global = renamed


def load_with_mbridge(bridge: Any, chunks: list[torch.nn.Module], root: Path) -> None:
    """mbridge's load_weights into the chunks (the host copies of swap/stream builds), reading the
    safetensors files of the checked directory `root` (its hub lookup bypassed)."""
    bridge._get_actual_hf_path = lambda _path: str(root)  # mbridge: cached_file(path), a hub lookup
    with torch.no_grad(), weights_on_host(chunks), copying_into_model(root):
        bridge.load_weights([unwrap(chunk) for chunk in chunks], str(root))
