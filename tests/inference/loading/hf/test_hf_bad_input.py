"""Bad input to build_inference_model_from_hf, each refused with the path and what to do before
any model is built (nothing allocated): no directory, no config.json, a family or feature the
converter does not map, pickle-only, missing, unlisted, truncated or mis-shaped weight files,
parallel sizes that do not divide the model. Checkpoints written without transformers."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_rl_patches import build_inference_model_from_hf
from megatron_rl_patches.inference.loading.errors import WeightsMismatchError
from megatron_rl_patches.inference.loading.hf import UnsupportedCheckpointError
from megatron_rl_patches.inference.loading.hf.families import REGISTRY
from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_safetensors, write_tiny_checkpoint

pytestmark = pytest.mark.megatron



def test_a_path_that_is_not_a_directory(megatron_cpu, no_build, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'Qwen/Qwen3-8B' does not exist; pass a local Hugging Face") as caught:
        build_inference_model_from_hf("Qwen/Qwen3-8B")  # a hub id is not fetched
    # transformers 5's huggingface_hub ships the `hf` command only (no huggingface-cli)
    assert "`hf download ORG/NAME --local-dir DIR`" in str(caught.value)
    (tmp_path / "file").write_text("")
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        build_inference_model_from_hf(tmp_path / "file")
    with pytest.raises(TypeError, match="path must be a path"):
        build_inference_model_from_hf(3)


def test_no_config_json(megatron_cpu, no_build, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"has no config.json; pass the directory"):
        build_inference_model_from_hf(tmp_path)


@pytest.mark.parametrize(("overrides", "match"), [
    ({"model_type": "gemma3", "architectures": ["Gemma3ForCausalLM"]},
     r"model_type 'gemma3' \(architectures \['Gemma3ForCausalLM'\]\) is not served .* qwen3_moe, qwen3_next"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 5e5, "factor": 2.0}}, r"RoPE scaling .dynamic. is not"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
    *[({"model_type": kind}, rf"model_type '{kind}' is not served by the Hugging Face converter: {why}")
      for kind, why in [("glm4", "GLM-4 dense adds norms"), ("glm_moe_dsa", "GLM-5.s sparse attention"),
                        ("minimax_m2", "MiniMax-M2 normalizes"), ("gpt_oss", "gpt-oss has attention sinks")]],
    ({"model_type": "glm4_moe", **REGISTRY["glm4_moe"].tiny_fields, "n_group": 2,
      "topk_group": 1}, r"n_group=2 with topk_group=1 and num_experts_per_tok=4 \(megatron-core scores a group"),
    ({"model_type": "glm4_moe", **REGISTRY["glm4_moe"].tiny_fields, "norm_topk_prob": False},
     r"norm_topk_prob=false"),
    ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4096},
     r"sliding_window=4096"),
])
def test_unserved_family_or_feature(megatron_cpu, no_build, tmp_path, overrides, match):
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config("qwen3", **overrides)))
    with pytest.raises(UnsupportedCheckpointError, match=match):
        build_inference_model_from_hf(tmp_path)


def test_pickle_only_checkpoint_is_never_read(megatron_cpu, no_build, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config("qwen3")))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(FileNotFoundError, match=r"no model.safetensors .* pytorch_model.bin: pickle files are never"):
        build_inference_model_from_hf(tmp_path)


def test_missing_and_unlisted_weight_files(megatron_cpu, no_build, tmp_path):
    write_tiny_checkpoint(tmp_path, tiny_hf_config("qwen3"), shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").rename(tmp_path / "elsewhere")
    with pytest.raises(FileNotFoundError, match=r"lacks 1 weight file\(s\) .*: model-00002-of-00002.safetensors"):
        build_inference_model_from_hf(tmp_path)
    (tmp_path / "elsewhere").rename(tmp_path / "model-00002-of-00002.safetensors")
    write_safetensors(tmp_path / "stale.safetensors", {"x": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"1 safetensors file\(s\) its .* does not list: stale.safetensors; remove"):
        build_inference_model_from_hf(tmp_path)


def test_missing_extra_and_misshapen_tensors(megatron_cpu, no_build, tmp_path):
    tensors = write_tiny_checkpoint(tmp_path, tiny_hf_config("qwen3"))
    tensors.pop("model.layers.1.self_attn.k_norm.weight")
    tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(48, 32)
    tensors["model.norm.weight"] = torch.zeros(31)
    write_safetensors(tmp_path / "model.safetensors", tensors)
    with pytest.raises(WeightsMismatchError) as caught:
        build_inference_model_from_hf(tmp_path)
    assert caught.value.missing == ["model.layers.1.self_attn.k_norm.weight"]
    assert caught.value.unexpected == ["model.layers.2.mlp.up_proj.weight"]
    assert caught.value.shape_mismatches == ["model.norm.weight (checkpoint (31,), config.json (32,))"]
    assert str(tmp_path) in str(caught.value)


def test_mtp_tensors_are_skipped_only_where_the_config_has_mtp_layers(megatron_cpu, no_build, tmp_path):
    """A GLM checkpoint's MTP layer (one more model.layers.N.) is skipped when config.json says
    num_nextn_predict_layers; without it the same tensors are unexpected (the skip is not a blanket one)."""
    from megatron_rl_patches.inference.loading.hf.load import checked_index
    from megatron_rl_patches.testing.hf_checkpoints import add_mtp_tensors

    for mtp in (1, 0):
        root = tmp_path / f"mtp{mtp}"
        write_tiny_checkpoint(root, tiny_hf_config("glm4_moe", num_nextn_predict_layers=mtp))
        add_mtp_tensors(root, "model.layers.2.")
        arch = REGISTRY["glm4_moe"].architecture(json.loads((root / "config.json").read_text()), str(root))
        if mtp:
            assert "model.layers.2.eh_proj.weight" in checked_index(root, arch)  # present, accepted, never read
        else:
            with pytest.raises(WeightsMismatchError) as caught:
                checked_index(root, arch)
            assert sorted(caught.value.unexpected) == [f"model.layers.2.{n}.weight" for n in ("eh_proj", "enorm",
                                                                                                "hnorm")]


def test_truncated_file(megatron_cpu, no_build, tmp_path):
    write_tiny_checkpoint(tmp_path, tiny_hf_config("qwen3"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"model.safetensors' is truncated .* download it again"):
        build_inference_model_from_hf(tmp_path)


def test_without_model_parallel_state(megatron_cpu, no_build, tmp_path):
    write_tiny_checkpoint(tmp_path, tiny_hf_config("qwen3", num_hidden_layers=3))
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        build_inference_model_from_hf(tmp_path)
    parallel_state.initialize_model_parallel(1, 1)


def test_bad_options(megatron_cpu, no_build, tmp_path):
    write_tiny_checkpoint(tmp_path, tiny_hf_config("qwen3"))
    with pytest.raises(ValueError, match="dtype must be"):
        build_inference_model_from_hf(tmp_path, dtype="int8")
    with pytest.raises(ValueError, match="residency"):
        build_inference_model_from_hf(tmp_path, residency="elsewhere")
    with pytest.raises(ValueError, match="make_vocab_size_divisible_by"):
        build_inference_model_from_hf(tmp_path, make_vocab_size_divisible_by=0)
    with pytest.raises(TypeError, match="core_attention must be an attention core class"):
        build_inference_model_from_hf(tmp_path, core_attention="TEDotProductAttention")


def test_another_attention_core_takes_the_same_weights(megatron_cpu, tmp_path):
    """core_attention= swaps the parameter-free core only (here the test kit's packed-input core):
    the same state dict, the same output on an unpacked batch."""
    from megatron_rl_patches.testing.megatron_cpu import make_batch
    from megatron_rl_patches.testing.packed_gpt import packed_attention_class

    write_tiny_checkpoint(tmp_path, tiny_hf_config("qwen3"))
    plain = build_inference_model_from_hf(tmp_path, dtype=torch.float32)[0]
    core = packed_attention_class()  # a new class per call
    packed = build_inference_model_from_hf(tmp_path, dtype=torch.float32, core_attention=core)[0]
    assert all(type(layer.self_attention.core_attention) is core for layer in packed.decoder.layers)
    assert type(plain.decoder.layers[0].self_attention.core_attention).__name__ == "DotProductAttention"
    assert plain.state_dict().keys() == packed.state_dict().keys()
    batch = make_batch(batch_size=1, seq_length=8, vocab_size=1001, seed=2)
    with torch.no_grad():
        args = batch["tokens"], batch["position_ids"], batch["attention_mask"]
        torch.testing.assert_close(packed(*args), plain(*args), rtol=0, atol=0)


def test_a_checkpoint_written_without_transformers_loads_every_tensor(megatron_cpu, tmp_path):
    """The loader alone (no reference): every parameter of the build comes from the file, sharded
    checkpoints included (values checked on three of them)."""
    tensors = write_tiny_checkpoint(tmp_path, tiny_hf_config("qwen3"), shards=3)
    chunk = build_inference_model_from_hf(tmp_path)[0]
    assert chunk.hf_vocab_size == 1001
    state = chunk.state_dict()
    assert torch.equal(state["decoder.layers.1.input_layernorm.weight"],
                       tensors["model.layers.1.input_layernorm.weight"])
    assert torch.equal(state["decoder.layers.0.pre_mlp_layernorm.weight"],
                       tensors["model.layers.0.post_attention_layernorm.weight"])
    assert torch.equal(state["output_layer.weight"][:1001], tensors["lm_head.weight"])
    assert not state["output_layer.weight"][1001:].any()  # Megatron's padding rows: zeros


def test_dtype_follows_the_checkpoint_unless_given(megatron_cpu, tmp_path):
    """config.json's dtype (bfloat16 here) is the default: a Float16Module-wrapped bf16 build whose
    weights are the file's rounded once; dtype=torch.float32 keeps them exact."""
    tensors = write_tiny_checkpoint(tmp_path, tiny_hf_config("qwen3", dtype="bfloat16"))
    want = tensors["model.layers.0.self_attn.o_proj.weight"]
    bf16 = build_inference_model_from_hf(tmp_path)[0]
    weight = bf16.module.decoder.layers[0].self_attention.linear_proj.weight
    assert type(bf16).__name__ == "Float16Module" and weight.dtype == torch.bfloat16
    assert torch.equal(weight, want.to(torch.bfloat16))
    fp32 = build_inference_model_from_hf(tmp_path, dtype=torch.float32)[0]
    assert torch.equal(fp32.decoder.layers[0].self_attention.linear_proj.weight, want)


def test_a_budget_the_teacher_cannot_fit_even_streamed(megatron_cpu, no_build, tmp_path):
    from megatron_rl_patches import ResidencyBudget

    write_tiny_checkpoint(tmp_path, tiny_hf_config("qwen3"))
    # fp32: the largest piece is the padded output layer, 1024 x 32 + 32 (final norm) parameters
    largest = (1024 * 32 + 32) * 4
    with pytest.raises(ValueError, match=rf"does not fit budget=.* residency='stream': this rank needs {largest} "):
        build_inference_model_from_hf(tmp_path, residency="stream", budget=ResidencyBudget(largest - 1))
    with pytest.raises(ValueError, match=r"residency='swap': .* \(its whole shard\)"):
        build_inference_model_from_hf(tmp_path, residency="swap", budget=ResidencyBudget(largest))


def test_a_budget_that_fits_the_largest_piece_streams(megatron_cpu, tmp_path):
    from megatron_rl_patches import ResidencyBudget

    write_tiny_checkpoint(tmp_path, tiny_hf_config("qwen3"))
    build_inference_model_from_hf(tmp_path, residency="stream", budget=ResidencyBudget((1024 * 32 + 32) * 4))


@pytest.mark.usefixtures("megatron_cpu")
def test_the_no_build_guard_has_teeth(no_build, tmp_path):
    """A checkpoint the builder serves reaches the build, where the guard stops it: the refusal
    tests above prove something only while the guard covers the path the builder takes."""
    from megatron_rl_patches.inference.loading.hf import build_inference_model_from_hf

    write_tiny_checkpoint(tmp_path, tiny_hf_config("qwen3"))
    with pytest.raises(AssertionError, match="built before the input was refused"):
        build_inference_model_from_hf(tmp_path)
