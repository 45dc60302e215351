"""The pieces the families share: a RMSNorm decoder layer's attention (q/k/v/o, optional q/k/v
biases and per-head q/k norms), its SwiGLU MLP, and a routed mixture of SwiGLU experts; each as
the Hugging Face tensors it holds and the Megatron local-spec parameters made from them; and the
keywords naming a pipeline stage to megatron-core's block spec (`stage_args`)."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

from dataclasses import fields
from typing import Any

from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture, UnsupportedCheckpointError
from megatron_rl_patches.inference.loading.hf.families.common_kinds import GATED, QKV, REPLICATE, ROW
from megatron_rl_patches.inference.loading.hf.families.family import Param, Shape


def attention_tensors(arch: HFArchitecture) -> dict[str, Shape]:
    """The two layer norms and the attention's tensors (biases and q/k norms where `arch` has them)."""
    h, hd = arch.hidden_size, arch.head_dim
    q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
    out: dict[str, Shape] = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
    }
    if arch.qkv_bias:
        out.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    if arch.qk_norm:
        out.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    return out


def attention_params(arch: HFArchitecture) -> dict[str, Param]:
    """q/k/v fused per query group (Megatron's linear_qkv), the norms whole on every rank."""
    qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    out = {
        "input_layernorm.weight": Param(("input_layernorm.weight",), REPLICATE),
        "pre_mlp_layernorm.weight": Param(("post_attention_layernorm.weight",), REPLICATE),
        "self_attention.linear_qkv.weight": Param(tuple(p + ".weight" for p in qkv), QKV),
        "self_attention.linear_proj.weight": Param(("self_attn.o_proj.weight",), ROW),
    }
    if arch.qkv_bias:
        out["self_attention.linear_qkv.bias"] = Param(tuple(p + ".bias" for p in qkv), QKV)
    if arch.qk_norm:
        out["self_attention.q_layernorm.weight"] = Param(("self_attn.q_norm.weight",), REPLICATE)
        out["self_attention.k_layernorm.weight"] = Param(("self_attn.k_norm.weight",), REPLICATE)
    return out


def swiglu_tensors(arch: HFArchitecture, hf: str = "mlp.", ffn: int | None = None) -> dict[str, Shape]:
    """A SwiGLU MLP's gate, up and down projections under `hf` (ffn: its width, default the dense one)."""
    h, f = arch.hidden_size, ffn or arch.ffn_hidden_size
    return {hf + "gate_proj.weight": (f, h), hf + "up_proj.weight": (f, h), hf + "down_proj.weight": (h, f)}


def swiglu_params(hf: str = "mlp.", megatron: str = "mlp.") -> dict[str, Param]:
    """gate and up stacked into linear_fc1 (each split over the ranks), down as linear_fc2."""
    return {megatron + "linear_fc1.weight": Param((hf + "gate_proj.weight", hf + "up_proj.weight"), GATED),
            megatron + "linear_fc2.weight": Param((hf + "down_proj.weight",), ROW)}


def moe_tensors(arch: HFArchitecture, shared: str | None = None) -> dict[str, Shape]:
    """The router and one expert's SwiGLU (`{e}`: every expert has the same); the shared expert
    under the checkpoint's prefix `shared` where `arch` has one."""
    out = {"mlp.gate.weight": (arch.num_experts, arch.hidden_size),
           **swiglu_tensors(arch, "mlp.experts.{e}.", arch.expert_ffn_hidden_size)}
    if shared is not None and arch.shared_expert_ffn:
        out.update(shared_expert_tensors(arch, shared))
    return out


def moe_params(arch: HFArchitecture, shared: str | None = None) -> dict[str, Param]:
    """megatron-core's router and local experts; its shared experts as `moe_tensors`' (`shared`)."""
    out = {"mlp.router.weight": Param(("mlp.gate.weight",), REPLICATE),
           **swiglu_params("mlp.experts.{e}.", "mlp.experts.local_experts.{e}.")}
    if shared is not None and arch.shared_expert_ffn:
        out.update(shared_expert_params(arch, shared))
    return out


def moe_config(arch: HFArchitecture) -> dict[str, Any]:
    """TransformerConfig fields of the routed experts (SequentialMLP) and what their router does:
    a top-k softmax by default, the sigmoid router's fields where `arch` has one (sigmoid_router.py);
    shared experts (gated or not); dense first layers."""
    import torch  # lazy: import cost: memory --hf plans without torch (the families are read there)

    values: dict[str, Any] = dict(
        num_moe_experts=arch.num_experts,
        moe_router_topk=arch.experts_per_token,
        moe_ffn_hidden_size=arch.expert_ffn_hidden_size,
        moe_router_score_function="softmax",
        # softmax over the top-k logits = the renormalized top-k probabilities (norm_topk_prob);
        # megatron-core's sigmoid router always renormalizes (the families refuse it otherwise)
        moe_router_pre_softmax=arch.sigmoid_router is None and not arch.norm_topk_prob,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        # gloo has no all-to-all: the allgather dispatcher where there is no GPU
        moe_token_dispatcher_type="alltoall" if torch.cuda.is_available() else "allgather",
    )
    if top1_renormalized(arch):
        # weight 1 for the one expert: exact as softmax over its logit; the TransformerConfig asks for
        # pre-softmax at top-1 (a training concern: zero gradients), not asked under sinkhorn, which is
        # set back to "none" before the router is made (after_init)
        values["moe_router_load_balancing_type"] = "sinkhorn"
    if arch.sigmoid_router is not None:  # GLM-4.5's / DeepSeek-V3's (families/sigmoid_router.py)
        values.update(arch.sigmoid_router.config_fields())
    if arch.shared_expert_ffn:
        values.update(moe_shared_expert_intermediate_size=arch.shared_expert_ffn, moe_shared_expert_overlap=False)
    if arch.shared_expert_gate:
        values["moe_shared_expert_gate"] = needs_config_field(arch, "moe_shared_expert_gate", "a gated shared expert")
    if arch.dense_layers:
        values["moe_layer_freq"] = [0] * arch.dense_layers + [1] * (arch.num_layers - arch.dense_layers)
    return values


def top1_renormalized(arch: HFArchitecture) -> bool:
    """A softmax router choosing one expert and renormalizing its weight (Mixtral at num_experts_per_tok 1)."""
    return arch.is_moe and arch.experts_per_token == 1 and arch.sigmoid_router is None and arch.norm_topk_prob


def after_init(arch: HFArchitecture) -> dict[str, Any]:
    """TransformerConfig attributes set once it is made, before the model: where its own checks refuse
    a value that is exact in inference (top-1 routing without pre-softmax)."""
    return {"moe_router_load_balancing_type": "none"} if top1_renormalized(arch) else {}


def shared_expert_tensors(arch: HFArchitecture, hf: str) -> dict[str, Shape]:
    """The shared expert's SwiGLU under `hf` and, where it is gated, its gate (`hf` without the dot + `_gate`)."""
    out = swiglu_tensors(arch, hf, arch.shared_expert_ffn)
    if arch.shared_expert_gate:
        out[hf.rstrip(".") + "_gate.weight"] = (1, arch.hidden_size)
    return out


def shared_expert_params(arch: HFArchitecture, hf: str) -> dict[str, Param]:
    """megatron-core's shared experts: linear_fc1 / linear_fc2 split like a dense MLP, the gate whole."""
    out = swiglu_params(hf, "mlp.shared_experts.")
    if arch.shared_expert_gate:
        out["mlp.shared_experts.gate_weight"] = Param((hf.rstrip(".") + "_gate.weight",), REPLICATE)
    return out


def dense_layer_tensors(arch: HFArchitecture, layer: int) -> dict[str, Shape]:
    """A dense layer: attention then a SwiGLU MLP."""
    return {**attention_tensors(arch), **swiglu_tensors(arch)}


def dense_layer_params(arch: HFArchitecture, layer: int) -> dict[str, Param]:
    return {**attention_params(arch), **swiglu_params()}


def needs_config_field(arch: HFArchitecture, name: str, what: str) -> bool:
    """True where megatron-core's TransformerConfig has the field `name`; UnsupportedCheckpointError
    naming the version otherwise."""
    from megatron.core import package_info
    from megatron.core.transformer.transformer_config import TransformerConfig

    if name not in {f.name for f in fields(TransformerConfig)}:
        raise UnsupportedCheckpointError(
            f"{arch.source}: {what} ({arch.model_type}) needs a megatron-core with TransformerConfig.{name} "
            f"(0.16.1 and 0.19.2 have it), this is megatron-core {package_info.__version__}"
        )
    return True


def stage_args(vp_stage: int | None, pp_rank: int | None) -> dict[str, Any]:
    """The keywords naming a pipeline stage to megatron-core's block spec and layer offset:
    `pp_rank` only where given (megatron-core 0.13.1 takes none and reads parallel_state's)."""
    return {"vp_stage": vp_stage, **({} if pp_rank is None else {"pp_rank": pp_rank})}
