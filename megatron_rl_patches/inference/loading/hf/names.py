"""The tensors a Hugging Face checkpoint of an HFArchitecture holds (name -> shape), derived from
config.json alone: the loader checks a checkpoint against it before reading any weight, and the
memory planner counts parameters from it."""
from __future__ import annotations

from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture

# tensors some exporters write that carry no weights (recomputed by the model)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def layer_tensors(arch: HFArchitecture, layer: int) -> dict[str, tuple[int, ...]]:
    """One decoder layer's tensors."""
    h, hd = arch.hidden_size, arch.head_dim
    q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
    p = f"model.layers.{layer}."
    out: dict[str, tuple[int, ...]] = {
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (q, h),
        p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h),
        p + "self_attn.o_proj.weight": (h, q),
    }
    if arch.qkv_bias:
        out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,)})
    if arch.qk_norm:
        out.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    if arch.is_moe:
        f = arch.expert_ffn_hidden_size
        out[p + "mlp.gate.weight"] = (arch.num_experts, h)
        for e in range(arch.num_experts):
            e_p = f"{p}mlp.experts.{e}."
            out.update({e_p + "gate_proj.weight": (f, h), e_p + "up_proj.weight": (f, h),
                        e_p + "down_proj.weight": (h, f)})
    else:
        f = arch.ffn_hidden_size
        out.update({p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                    p + "mlp.down_proj.weight": (h, f)})
    return out


def checkpoint_tensors(arch: HFArchitecture) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, by name (the output layer only when untied)."""
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, arch.hidden_size)}
    for layer in range(arch.num_layers):
        out.update(layer_tensors(arch, layer))
    out["model.norm.weight"] = (arch.hidden_size,)
    if not arch.tied:
        out["lm_head.weight"] = (arch.vocab_size, arch.hidden_size)
    return out
