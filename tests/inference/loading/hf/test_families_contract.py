"""The Hugging Face family contract: for every registered family, its tensors per layer, its
Megatron parameter map (the converter's sources) and the memory plan agree, checked from config.json
alone (`contract_problems`) and on a real local-spec build on CPU (every checkpoint tensor is
consumed exactly once by the state dict, every parameter's sources fill it, the plan counts the
build's parameters). Synthetic families that break it are refused: the check can fail."""
from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from megatron_rl_patches.inference.loading.hf import UnsupportedCheckpointError, hf_memory_plan
from megatron_rl_patches.inference.loading.hf.contract import contract_problems
from megatron_rl_patches.inference.loading.hf.families import FAMILIES, REGISTRY, architecture, family_for, qwen3
from megatron_rl_patches.inference.loading.hf.families.common import dense_layer_params, dense_layer_tensors
from megatron_rl_patches.inference.loading.hf.families.family import Param
from megatron_rl_patches.inference.loading.hf.mbridge_adapter import SERVED
from megatron_rl_patches.inference.loading.hf.names import checkpoint_tensors
from megatron_rl_patches.testing.hf_checkpoints import HF_KINDS, tiny_hf_config

NAMES = [family.name for family in FAMILIES]
QWEN3_5_KINDS = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")  # >= 0.16
# each family as the tiny kit writes it, tied, and with the other q/k/v bias default
VARIANTS = [(name, {}) for name in NAMES] + [(name, {"tie_word_embeddings": True}) for name in NAMES] + [
    ("llama", {"attention_bias": True}), ("qwen2_moe", {"qkv_bias": False}), ("mixtral", {"num_experts_per_tok": 1})]
IDS = ["-".join([kind, *overrides]) for kind, overrides in VARIANTS]


@pytest.mark.parametrize(("kind", "overrides"), VARIANTS, ids=IDS)
def test_every_registered_family_keeps_the_contract(kind, overrides):
    assert contract_problems(REGISTRY[kind], tiny_hf_config(kind, **overrides)) == []


def test_the_family_list_exists_once():
    assert HF_KINDS == tuple(NAMES) and set(REGISTRY) == {t for f in FAMILIES for t in f.model_types}
    assert SERVED == tuple(sorted(t for f in FAMILIES if f.mbridge for t in f.model_types))
    for kind in HF_KINDS:
        assert family_for(kind) is REGISTRY[kind] and architecture(tiny_hf_config(kind)).model_type == kind
    with pytest.raises(UnsupportedCheckpointError, match=r"model_type 'gemma3' .*maps " + ", ".join(sorted(REGISTRY))):
        family_for("gemma3")


def test_the_family_is_looked_up_once_and_carried_by_the_architecture():
    """The build reads config.json's family once (families.architecture); the modules below it
    take `arch.family` (a walk of one build looked it up 13 times, from 6 modules)."""
    for kind in HF_KINDS:
        arch = architecture(tiny_hf_config(kind))
        assert arch.family is REGISTRY[kind]
        assert dataclasses.replace(arch, family=None) == arch and "family" not in repr(arch)  # not the record's value
    hf = Path(architecture.__code__.co_filename).parent.parent  # loading/hf/
    again = [str(path.relative_to(hf)) for path in sorted(hf.rglob("*.py"))
             if "family_for(" in path.read_text() and path != hf / "families" / "__init__.py"]
    assert again == []


def _broken(**hooks):
    return dataclasses.replace(qwen3.FAMILY, name="broken", **hooks)


def _extra_tensor(arch, layer):
    return {**dense_layer_tensors(arch, layer), "mlp.extra.weight": (4, arch.hidden_size)}


def _extra_param(arch, layer):
    return {**dense_layer_params(arch, layer), "mlp.extra.weight": Param(("mlp.missing.weight",), "row")}


def _o_proj_twice(arch, layer):
    return {**dense_layer_params(arch, layer), "self_attention.linear_proj.bias": Param(("self_attn.o_proj.weight",),
                                                                                        "replicate")}


def _qkv_of_two(arch, layer):
    return {**dense_layer_params(arch, layer),
            "self_attention.linear_qkv.weight": Param(("self_attn.q_proj.weight", "self_attn.k_proj.weight"), "qkv")}


@pytest.mark.parametrize(("hooks", "expected"), [
    ({"layer_tensors": _extra_tensor}, ["tensor mlp.extra.weight makes no Megatron parameter",
                                        "the memory plan counts 7760 parameters, the checkpoint holds 7888"]),
    ({"layer_params": _extra_param}, ["mlp.missing.weight, which is not a tensor of the checkpoint",
                                      "the memory plan cannot count parameter tensor 'mlp.missing.weight'"]),
    ({"layer_params": _o_proj_twice}, ["tensor self_attn.o_proj.weight is fused into 2 parameters",
                                       "the memory plan counts 8784 parameters, the checkpoint holds 7760"]),
    ({"layer_params": _qkv_of_two}, ["kind 'qkv' fuses 2 tensors, expected 3",
                                     "tensor self_attn.v_proj.weight makes no"]),
], ids=["tensor-without-source", "source-without-tensor", "tensor-fused-twice", "qkv-of-two"])
def test_a_family_whose_tensors_and_plan_disagree_breaks_the_contract(hooks, expected):
    problems = contract_problems(_broken(**hooks), tiny_hf_config("qwen3"))
    assert len(problems) >= 2 * len(expected)  # both layers
    for text in expected:
        assert any(text in problem for problem in problems), (text, problems)


@pytest.mark.megatron
@pytest.mark.usefixtures("moe_router_on_cpu")
@pytest.mark.parametrize(("kind", "overrides"), VARIANTS, ids=IDS)
def test_a_real_build_consumes_every_tensor_once_and_the_plan_counts_it(megatron_cpu, tmp_path, kind, overrides):
    from megatron_rl_patches.inference.loading.hf.convert import source
    from megatron_rl_patches.inference.loading.hf.model import model_provider, padded_vocab, transformer_config

    config = tiny_hf_config(kind, **overrides)
    arch = architecture(config)
    vocab = padded_vocab(arch.vocab_size, 128, 1)
    try:
        config_ = transformer_config(arch, torch.float32)
    except UnsupportedCheckpointError as exc:  # a family this megatron-core lacks a module for, named
        assert "needs a megatron-core with" in str(exc) and kind in ("qwen2_moe", *QWEN3_5_KINDS)
        pytest.skip(str(exc))
    model = model_provider(arch, config_, vocab)()
    tensors = checkpoint_tensors(arch)
    numbers = {i: int(layer.layer_number) - 1 for i, layer in enumerate(model.decoder.layers)}
    used: Counter[str] = Counter()
    for key, target in model.state_dict().items():
        if key.endswith("_extra_state"):
            continue
        src = source(arch, key, numbers, 0)
        used.update(src.hf_names)
        made = sum(torch.Size(tensors[name]).numel() for name in src.hf_names)
        if src.kind.name == "vocab":
            made = vocab * arch.hidden_size  # Megatron's padded rows
        assert made == target.numel(), key
    assert used == Counter(dict.fromkeys(tensors, 1))
    (tmp_path / "config.json").write_text(json.dumps(config))
    plan = hf_memory_plan(tmp_path, param_dtype="fp32")
    held = [t for k, t in model.state_dict().items() if not k.endswith("_extra_state")]  # a router's bias too
    assert plan.stage_params == (sum(t.numel() for t in held),)
    assert plan.total_params == sum(torch.Size(shape).numel() for shape in tensors.values())
