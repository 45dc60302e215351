"""Which config.json fields each family reads, held against transformers' own modeling code (issue 55
item 2): a field transformers' forward of the family reads is read by the family's reader (served,
or refused by name), and a field it ignores is ignored: set to an unusual value it changes nothing.
partial_rotary_factor, applied to every family, put llama / qwen2 / qwen3 4.1-5.0 nats from
transformers' forward, which ignores it there."""
from __future__ import annotations

import importlib
import inspect
import re

import pytest
import torch
from kit.hf_scores import built_log_probs, transformers_log_probs

from megatron_rl_patches.inference.loading.hf import UnsupportedCheckpointError
from megatron_rl_patches.inference.loading.hf.families import FAMILIES, REGISTRY, architecture
from megatron_rl_patches.inference.loading.hf.families.fields import SHARED
from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config

# transformers' module of each family (mimo: remote code on transformers' Qwen2; the text models: the wrapper's)
MODULE = {"mimo": "qwen2", "qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}
# read by transformers only in training, for the attention kernel, or for generation: no log-prob depends on them
RUNTIME = {"_attn_implementation", "attention_dropout", "initializer_range", "pad_token_id", "output_router_logits",
           "router_aux_loss_coef", "router_jitter_noise", "image_token_id", "video_token_id", "rope_parameters"}
# the vision tower's fields (a wrapper's vision_config, counted by `memory --hf`, not built)
VISION = {"depth", "in_channels", "num_heads", "num_position_embeddings", "out_hidden_size", "patch_size",
          "spatial_merge_size", "temporal_patch_size"}
# read by the family's config class into what its forward reads (checked to appear in that class's module)
DERIVED = [("layer_types", {"use_sliding_window", "max_window_layers"}), ("sliding_window", {"use_sliding_window"}),
           ("num_local_experts", {"n_routed_experts"}), ("layer_types", {"full_attention_interval"})]
# read by our reader though transformers' forward does not, each for a reason
OWN = {
    "num_nextn_predict_layers": "real checkpoints store MTP layers: their tensors are skipped",
    "scoring_func": "DeepSeek's and Kimi-K2's remote code read it: refused unless sigmoid",
    "first_k_dense_replace": "glm4_moe_lite: refused where it contradicts transformers' default dense layer",
    "sliding_window": "refused with use_sliding_window / layer_types (mixtral reads it directly)",
    "vision_config": "the vision tower, sized by `memory --hf`",
    "text_config": "the wrapper's text model",
}


def transformers_reads(family) -> tuple[set[str], set[str]]:
    """(config attributes transformers' modeling module of `family` reads, keys of rope_parameters it reads)."""
    name = MODULE.get(family.name, family.name)
    source = inspect.getsource(importlib.import_module(f"transformers.models.{name}.modeling_{name}"))
    reads = set(re.findall(r"config\.(\w+)", source)) | set(re.findall(r"getattr\(\s*config\s*,\s*[\"'](\w+)", source))
    rope = set(re.findall(r"rope_parameters(?:\[[^\]]*\])?(?:\.get\(|\[)\s*[\"'](\w+)", source))
    return reads, rope


def config_class(family):
    """transformers' config class of the family's text model (a wrapper's text config, where it has one)."""
    import transformers

    name = REGISTRY[MODULE.get(family.name, family.name)].hf_class.removesuffix("Text")
    return getattr(transformers, f"{name}TextConfig", None) or getattr(transformers, f"{name}Config")


def config_source(family) -> str:
    name = MODULE.get(family.name, family.name)
    return inspect.getsource(importlib.import_module(f"transformers.models.{name}.configuration_{name}"))


@pytest.fixture(scope="module")
def modeling(transformers):
    return {family.name: transformers_reads(family) for family in FAMILIES}


@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_the_fields_a_family_reads_are_the_ones_transformers_reads(modeling, name):
    """transformers' modeling module's `config.X` reads, with the config.json names its config class
    maps onto them (attribute_map: one field under two names, refused where they differ)."""
    family = REGISTRY[name]
    reads, _ = modeling[name]
    ours = SHARED | family.fields
    wanted = reads - RUNTIME - VISION
    for target, sources in DERIVED:  # the config.json fields the config class turns into `target`
        if target in wanted and all(s in config_source(family) for s in sources):
            wanted |= sources
    for target, sources in DERIVED:
        if target in wanted and target not in ours and sources <= ours:
            wanted.discard(target)  # read under the config.json name the class maps
    synonyms = {frozenset((alias, target)) for alias, target in config_class(family).attribute_map.items()
                if {alias, target} & (wanted | family.fields)}
    assert synonyms == {frozenset(names) for names in family.synonyms}, f"{name}: names transformers maps as one"
    wanted |= {alias for pair in synonyms for alias in pair}
    assert wanted - ours == set(), f"{name}: transformers reads these, the family's reader never sees them"
    extra = family.fields - wanted - set(OWN)
    assert extra == set(), f"{name}: the reader sees fields transformers' {name} forward ignores"


@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_partial_rotary_factor_applies_where_transformers_reads_it(modeling, name):
    """Its default RoPE reads partial_rotary_factor (glm4_moe, glm4_moe_lite, qwen3_5, qwen3_next) or
    ignores it (llama, qwen2, qwen3, mixtral, deepseek_v3...): the build follows, or refuses by name."""
    _, rope = modeling[name]
    config = tiny_hf_config(name)
    text = config.get("text_config", config)
    base = architecture(config)
    for where in ("top", "rope_parameters"):
        if where == "top":
            changed = {**text, "partial_rotary_factor": 0.5,
                       "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
        else:
            changed = {**text, "rope_parameters": {**text["rope_parameters"], "partial_rotary_factor": 0.5}}
        if "partial_rotary_factor" not in rope:
            assert architecture(changed) == base, where
            continue
        try:
            assert architecture(changed).rope.partial == 0.5, where
        except UnsupportedCheckpointError as exc:  # multi-latent attention rotates its rope dims whole
            assert "partial_rotary_factor 0.5" in str(exc) and base.mla is not None


# fields each family's transformers forward ignores, set to values that would change a build reading them
IGNORED = {
    "partial_rotary_factor": "x", "attention_bias": True, "mlp_bias": True, "use_sliding_window": True,
    "norm_topk_prob": "maybe", "num_experts": 3, "qkv_bias": False, "use_qk_norm": True, "scoring_func": "softmax",
    "shared_expert_intermediate_size": -1, "decoder_sparse_step": 2, "mlp_only_layers": [0], "n_group": 3,
}


@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_a_field_transformers_ignores_changes_nothing(modeling, name):
    family = REGISTRY[name]
    reads, rope = modeling[name]
    config = tiny_hf_config(name)
    base = architecture(config)
    checked = 0
    for field, value in IGNORED.items():
        if field in family.fields or field in reads or (field == "partial_rotary_factor" and field in rope):
            continue
        odd = {**config, field: value}
        if field == "partial_rotary_factor" and isinstance(config["rope_parameters"], dict):
            odd["rope_parameters"] = {**config["rope_parameters"], field: value}
        assert architecture(odd) == base, field
        checked += 1
    assert checked >= 2


@pytest.fixture
def fused_processors(clean_patch_state):
    import megatron_rl_patches

    megatron_rl_patches.apply(only="gpt_output_processor")  # `native` on >= 0.18


@pytest.mark.megatron
@pytest.mark.usefixtures("transformers", "fused_processors")
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("where", ["top", "rope_parameters"])
def test_partial_rotary_factor_ignored_as_transformers_does(megatron_cpu, tmp_path, kind, where):
    """The build rotated a quarter of each head where transformers rotates all of it (4.1-5.0 nats)."""
    from megatron_rl_patches import build_inference_model_from_hf
    from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf
    from megatron_rl_patches.testing.megatron_cpu import make_batch

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    overrides = ({"partial_rotary_factor": 0.25} if where == "top"
                 else {"rope_parameters": {**rope, "partial_rotary_factor": 0.25}})
    model = save_tiny_hf(tmp_path, kind, seed=3, max_position_embeddings=128, **overrides)
    batch = make_batch(batch_size=2, seq_length=48, vocab_size=1001, seed=0)
    want = transformers_log_probs(model, batch)
    got = built_log_probs(build_inference_model_from_hf(tmp_path, dtype=torch.float32)[0], batch, 1001)
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mixtral", "deepseek_v3"])
def test_partial_rotary_factor_with_scaled_rope_refused_where_the_attention_rotates_whole_heads(kind):
    """transformers' scaled RoPE reads it, its attention of these families does not: its own forward fails."""
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    with pytest.raises(UnsupportedCheckpointError, match=r"'linear' with partial_rotary_factor=0.5"):
        architecture(tiny_hf_config(kind, rope_parameters=rope))


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "qwen2_moe"])
def test_sliding_windows_written_per_layer_are_refused(kind):
    """transformers' Qwen2 / Qwen3 read layer_types: a sliding layer built as full attention (silently)."""
    with pytest.raises(UnsupportedCheckpointError, match=r"layer_types with 'sliding_attention'"):
        architecture(tiny_hf_config(kind, layer_types=["full_attention", "sliding_attention"], sliding_window=4))
    assert architecture(tiny_hf_config("llama", layer_types=["sliding_attention"] * 2)).num_layers == 2  # not read
