"""config.json defects build_inference_model_from_hf used to build silently wrong or refuse with a
bare error (issue 49): a scaled RoPE under rope_scaling beside rope_parameters, a tied config whose
checkpoint stores its own lm_head.weight (served untied, against transformers' own forward), field
types, the dtype named as given, counts config.json claims beyond the checkpoint's, and more experts
per token than experts. Each refusal names the field and comes before the model is built."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_rl_patches import build_inference_model_from_hf
from megatron_rl_patches.inference.loading.hf import UnsupportedCheckpointError
from megatron_rl_patches.testing.hf_checkpoints import (
    save_tiny_hf,
    tiny_hf_config,
    write_safetensors,
    write_tiny_checkpoint,
)
from megatron_rl_patches.testing.megatron_cpu import make_batch

pytestmark = pytest.mark.megatron



def _config(tmp_path, **overrides):
    """A complete tiny qwen3 checkpoint whose config.json then gets `overrides` (None: deleted)."""
    write_tiny_checkpoint(tmp_path, tiny_hf_config("qwen3"))
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(overrides)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return tmp_path


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 4.0},
                                     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}])
def test_rope_scaling_beside_rope_parameters_is_read_first(megatron_cpu, no_build, tmp_path, scaling):
    """transformers 5 reads rope_scaling first: a build of plain RoPE was 3.19 (linear) / 1.56 (yarn)
    nats off; the scaling is served (tests/inference/loading/hf/test_hf_families.py), the base
    taken from rope_parameters."""
    from megatron_rl_patches.inference.loading.hf import read_architecture

    root = _config(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rope_scaling=scaling)
    rope = read_architecture(root).rope
    assert (rope.kind, rope.factor, rope.theta) == (scaling["rope_type"], 4.0, 1e6)
    dynamic = _config(tmp_path / "dynamic", rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                      rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(UnsupportedCheckpointError, match="RoPE scaling 'dynamic' is not built exactly"):
        build_inference_model_from_hf(dynamic)


@pytest.mark.parametrize(("overrides", "match"), [
    ({"rms_norm_eps": "1e-6"}, r"config.json's rms_norm_eps must be a positive number, got '1e-6'"),
    ({"rope_parameters": None, "rope_theta": [1e6]}, r"config.json's rope_theta must be a positive number"),
    ({"rope_parameters": "default"}, r"config.json's rope_parameters must be an object .* got str 'default'"),
    ({"rope_scaling": [1, 2]}, r"config.json's rope_scaling must be an object"),
    ({"model_type": ["qwen3"]}, r"model_type \['qwen3'\] .* is not served"),
    ({"tie_word_embeddings": "false"}, r"config.json's tie_word_embeddings must be true or false, got 'false'"),
    ({"num_hidden_layers": 10**9}, r"config.json's num_hidden_layers=1000000000 but the checkpoint holds 2 layers"),
])
def test_a_config_field_of_the_wrong_type_or_size_is_named(megatron_cpu, no_build, tmp_path, overrides, match):
    """Were a bare float() / AttributeError / unhashable TypeError, bool("false") = tied, a MemoryError."""
    with pytest.raises(ValueError, match=match) as caught:
        build_inference_model_from_hf(_config(tmp_path, **overrides))
    assert str(tmp_path) in str(caught.value)


def test_more_experts_per_token_than_experts_is_refused(megatron_cpu, no_build, tmp_path):
    """It built, then the router's topk failed at the first forward."""
    write_tiny_checkpoint(tmp_path, tiny_hf_config("qwen3_moe"))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": config["num_experts"] + 1}))
    with pytest.raises(ValueError, match=r"num_experts_per_tok=5 exceeds num_experts=4"):
        build_inference_model_from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_experts": 10**8}))
    with pytest.raises(ValueError, match=r"num_experts=100000000 but the checkpoint holds 4 experts"):
        build_inference_model_from_hf(tmp_path)


@pytest.mark.parametrize(("dtype", "config_dtype", "match"), [
    ("bf16", None, r"dtype must be torch.float32, torch.bfloat16 or torch.float16 .* got 'bf16'"),
    (None, "float64", r"config.json's dtype is 'float64': the build serves float32, bfloat16 and float16"),
])
def test_the_dtype_error_names_what_was_given(megatron_cpu, no_build, tmp_path, dtype, config_dtype, match):
    """It said "got None" for both."""
    root = _config(tmp_path, dtype=config_dtype) if config_dtype else _config(tmp_path)
    with pytest.raises(ValueError, match=match):
        build_inference_model_from_hf(root, dtype=dtype)


@pytest.mark.usefixtures("transformers")
def test_a_tied_config_with_its_own_lm_head_is_served_untied_as_transformers_does(megatron_cpu, tmp_path):
    """tie_word_embeddings=true, yet the checkpoint stores an lm_head.weight that differs from the
    embedding: transformers 5 keeps both; the build tied it to embed_tokens (6.45 nats off)."""
    import transformers

    from megatron_rl_patches.inference.loading.hf.files import read_tensor, tensor_index

    untied = tmp_path / "untied"
    save_tiny_hf(untied, "qwen3", tie_word_embeddings=False)
    tensors = {name: read_tensor(entry) for name, entry in tensor_index(untied).items()}
    root = tmp_path / "tied"
    root.mkdir()
    write_safetensors(root / "model.safetensors", tensors)
    config = json.loads((untied / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    reference = transformers.AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).eval()
    assert not torch.equal(reference.lm_head.weight, reference.model.embed_tokens.weight)  # transformers: both kept
    batch = make_batch(batch_size=2, seq_length=12, vocab_size=1001, seed=0)
    chunk = build_inference_model_from_hf(root, dtype=torch.float32)[0]
    with torch.no_grad():
        want = torch.log_softmax(reference(batch["tokens"]).logits.double(), -1)
        got = torch.log_softmax(chunk(batch["tokens"], batch["position_ids"], batch["attention_mask"])
                                [..., :1001].double(), -1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
