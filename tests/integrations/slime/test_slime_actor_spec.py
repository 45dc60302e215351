"""The actor's `--spec` attention core for Hugging Face teachers inside slime
(integrations/megatron/opd/actor_spec.py; issue 50, item 7) without slime's source, on real megatron-core:
read from a layer spec, a block spec, a ModuleSpec around either and a core named by a ModuleSpec;
nothing read (megatron-core's local core, warned) from a model provider or layers of different
cores; a teacher built by `build_hf_teacher` for a local actor with `--spec` runs that core. slime's
real `forward_only` over packed batches with it: the slime lane's test_slime_hf_role_actor_spec_lane.py."""
from __future__ import annotations

import sys
import types
from argparse import Namespace

import pytest

from megatron_rl_patches.integrations.megatron.opd import actor_spec, hf_teachers

pytestmark = pytest.mark.megatron

MODULE = "actor_spec_under_test"


def _packed_layer():
    from megatron_rl_patches.testing.packed_gpt import packed_gpt_spec

    spec = packed_gpt_spec()
    return spec, spec.submodules.self_attention.submodules.core_attention


def test_the_core_is_read_from_every_shape_of_spec(megatron_cpu, caplog):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

    layer, core = _packed_layer()
    block = TransformerBlockSubmodules(layer_specs=[layer, _packed_layer()[0]])
    block.layer_specs[1].submodules.self_attention.submodules.core_attention = core
    assert actor_spec.spec_core_attention(layer) is core
    assert actor_spec.spec_core_attention(block) is core
    assert actor_spec.spec_core_attention(ModuleSpec(module=TransformerBlock, submodules=block)) is core
    named, _ = _packed_layer()
    named.submodules.self_attention.submodules.core_attention = ModuleSpec(module=core)
    assert actor_spec.spec_core_attention(named) is core
    # nothing to read: megatron-core's local core (None), as before
    mixed = TransformerBlockSubmodules(layer_specs=[layer, _packed_layer()[0]])
    mixed.layer_specs[1].submodules.self_attention.submodules.core_attention = DotProductAttention
    from megatron_rl_patches._log import forget_warnings

    forget_warnings()
    with caplog.at_level("WARNING", logger="megatron_rl_patches"):
        assert actor_spec.spec_core_attention(mixed, "the mixed spec") is None

        def provider(pre_process=True, post_process=True, vp_stage=None):
            return None

        assert actor_spec.spec_core_attention(provider, "the provider") is None
    warned = [r.getMessage() for r in caplog.records]
    assert any("the mixed spec gives no single attention core class" in m and "DotProductAttention" in m
               for m in warned), warned
    assert any("the provider gives no single attention core class to read (a model provider)" in m
               for m in warned), warned
    assert actor_spec.spec_core_attention(None) is None


def test_the_actors_spec_pair_is_imported_and_bad_ones_named(megatron_cpu, monkeypatch):
    layer, core = _packed_layer()
    module = types.ModuleType(MODULE)
    module.LAYER = layer
    monkeypatch.setitem(sys.modules, MODULE, module)
    assert actor_spec.spec_pair(Namespace(spec=None)) is None
    assert actor_spec.spec_pair(Namespace(spec=["local"])) is None  # Megatron's own local spec
    assert actor_spec.actor_layer_spec(Namespace(spec=[MODULE, "LAYER"])) is layer
    assert hf_teachers.packed_core_attention(Namespace(transformer_impl="local", spec=[MODULE, "LAYER"])) is core
    assert hf_teachers.packed_core_attention(Namespace(transformer_impl="local", spec=None)) is None
    with pytest.raises(ValueError, match=f"--spec {MODULE} MISSING: the actor's layer spec cannot be imported"):
        hf_teachers.packed_core_attention(Namespace(transformer_impl="local", spec=[MODULE, "MISSING"]))


def test_a_teacher_beside_a_local_actor_with_a_spec_runs_its_core(megatron_cpu, tmp_path, monkeypatch):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint

    layer, core = _packed_layer()
    module = types.ModuleType(MODULE)
    module.LAYER = layer
    monkeypatch.setitem(sys.modules, MODULE, module)
    write_tiny_checkpoint(tmp_path / "teacher", tiny_hf_config("qwen3", hidden_size=48, vocab_size=64))
    args = Namespace(transformer_impl="local", spec=[MODULE, "LAYER"], params_dtype=None,
                     make_vocab_size_divisible_by=64)
    for spec, expected in (([MODULE, "LAYER"], core), (None, DotProductAttention)):
        args.spec = spec
        (chunk,) = hf_teachers.build_hf_teacher(args, str(tmp_path / "teacher"), None, 64, None, "teacher")
        assert {type(layer.self_attention.core_attention) for layer in chunk.decoder.layers} == {expected}


def test_an_mla_teacher_needs_a_core_that_takes_its_key_and_value_widths(megatron_cpu, tmp_path, monkeypatch):
    """deepseek_v3 beside an actor whose spec core is megatron-core's local DotProductAttention (it
    does not take k_channels / v_channels): refused by name before the build; the kit's packed
    core, which takes them as Transformer Engine's does, builds."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint

    layer, core = _packed_layer()
    module = types.ModuleType(MODULE)
    module.LAYER = layer
    monkeypatch.setitem(sys.modules, MODULE, module)
    write_tiny_checkpoint(tmp_path / "teacher", tiny_hf_config("deepseek_v3", vocab_size=64))
    args = Namespace(transformer_impl="local", spec=[MODULE, "LAYER"], params_dtype=None,
                     make_vocab_size_divisible_by=64)
    (chunk,) = hf_teachers.build_hf_teacher(args, str(tmp_path / "teacher"), None, 64, None, "teacher")
    assert {type(layer.self_attention.core_attention) for layer in chunk.decoder.layers} == {core}
    layer.submodules.self_attention.submodules.core_attention = DotProductAttention
    with pytest.raises(TypeError, match="core_attention=DotProductAttention does not take k_channels / v_channels, "
                                        r"which .*teacher's multi-latent attention \(deepseek_v3\)"):
        hf_teachers.build_hf_teacher(args, str(tmp_path / "teacher"), None, 64, None, "teacher")
