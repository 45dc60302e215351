"""Every published config.json (tests/apps/cli/hf_configs/, as the model cards ship them: Qwen3.5's
text model nested under `text_config`) through every entry point that reads a checkpoint's config
(issue 55 item 1): `check_teacher_vocab`, the builder's `hf_vocab_size`, the architecture reader and
`memory --hf`'s plan, slime's Hugging Face teachers (the route against the actor and the vocabulary
check, as `prm_teacher` and OPD teachers without `;tokenizer=own` run it; the route alone for a
`;tokenizer=own` teacher), and `doctor`'s teacher check: each reads the same vocabulary and family.
Config directories only (no weights): JSON, no model built."""
from __future__ import annotations

from argparse import Namespace

import pytest
from kit.published_configs import NAMES, published_checkpoint, published_config

from megatron_rl_patches.inference.build_hf import hf_vocab_size
from megatron_rl_patches.inference.loading.hf import check_teacher_vocab, hf_memory_plan, read_architecture
from megatron_rl_patches.integrations.megatron.opd import hf_teachers
from megatron_rl_patches.integrations.megatron.opd.opd_settings import TEACHERS

WHAT = f"{TEACHERS}: teacher"
# the tiny actor the teachers are routed against (slime's args): every published model differs from it
ACTOR = Namespace(hidden_size=32, num_layers=2, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
                  kv_channels=8, ffn_hidden_size=48, num_experts=None, vocab_size=1001, hf_checkpoint=None)


def _text(name: str) -> dict:
    config = published_config(name)
    return config.get("text_config", config)


def test_the_fixtures_include_the_dense_and_wrapped_teachers_users_download():
    assert {"Llama-3.2-1B", "Qwen3-8B", "Qwen3.5-27B", "Qwen3.5-35B-A3B"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_every_entry_point_reads_the_same_vocabulary(tmp_path, name):
    """issue 55: check_teacher_vocab and slime's HF teacher path stopped on Qwen3.5's nested
    vocab_size ("config.json has no integer vocab_size") while the builder and doctor read it."""
    root = published_checkpoint(name, tmp_path)
    vocab = _text(name)["vocab_size"]
    assert check_teacher_vocab(root, vocab) == vocab
    assert check_teacher_vocab(root, root) == vocab  # the student's directory read the same way
    assert hf_vocab_size(root) == vocab
    assert read_architecture(root, sizing=True).vocab_size == vocab
    assert hf_memory_plan(root).padded_vocab >= vocab
    assert hf_teachers.check_vocab(str(root), vocab, f"{WHAT} {str(root)!r}") == vocab
    assert hf_teachers.student_vocab(Namespace(hf_checkpoint=str(root), vocab_size=1), 1) == str(root)
    with pytest.raises(ValueError, match=rf"has vocab_size={vocab} but the student has vocab_size={vocab + 1}"):
        check_teacher_vocab(root, vocab + 1)


@pytest.mark.parametrize("name", NAMES)
def test_slime_routes_each_published_teacher_by_its_text_models_shape(tmp_path, name):
    """A teacher of another shape than the actor is built from its config.json (the HF route, also
    a `;tokenizer=own` teacher's); Qwen3.5's nested sizes went unseen: routed into the actor's buffers."""
    root = published_checkpoint(name, tmp_path)
    text = _text(name)
    route, differences = hf_teachers.local_loading(str(root), ACTOR, WHAT)
    assert route == hf_teachers.HF
    assert f"hidden_size: teacher {text['hidden_size']}, actor 32" in differences
    assert f"vocab_size: teacher {text['vocab_size']}, actor 1001" in differences


@pytest.mark.parametrize("name", NAMES)
def test_doctor_reads_each_published_teacher_and_names_only_its_missing_weights(tmp_path, clean_patch_state, name):
    from megatron_rl_patches.apps.cli.doctor import teacher_problems

    root = published_checkpoint(name, tmp_path)
    clean_patch_state.setenv(TEACHERS, str(root))
    (problem,) = teacher_problems()
    assert "has no model.safetensors and no model.safetensors.index.json" in problem, problem


# slime's actor arguments for the published models (its scripts/models/deepseek-v3.sh and
# glm4.5-355B-A32B.sh at 624b824a, as Megatron-LM parses them: --moe-layer-freq a list)
SLIME_ACTORS = {
    "DeepSeek-V3": Namespace(
        hidden_size=7168, num_layers=61, num_attention_heads=128, group_query_attention=False, kv_channels=128,
        ffn_hidden_size=18432, vocab_size=129280, untie_embeddings_and_output_weights=True, add_qkv_bias=False,
        qk_layernorm=True, rotary_base=10000, norm_epsilon=1e-6, rotary_percent=1.0, multi_latent_attention=True,
        q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
        num_experts=256, moe_ffn_hidden_size=2048, moe_router_topk=8, moe_shared_expert_intermediate_size=2048,
        moe_layer_freq=[0] * 3 + [1] * 58),
    "GLM-4.5": Namespace(
        hidden_size=5120, num_layers=92, num_attention_heads=96, group_query_attention=True, num_query_groups=8,
        kv_channels=128, ffn_hidden_size=12288, vocab_size=151552, untie_embeddings_and_output_weights=True,
        add_qkv_bias=True, qk_layernorm=True, rotary_base=1000000, norm_epsilon=1e-5, rotary_percent=0.5,
        num_experts=160, moe_ffn_hidden_size=1536, moe_router_topk=8, moe_shared_expert_intermediate_size=1536,
        moe_layer_freq=[0] * 3 + [1] * 89),
}


@pytest.mark.parametrize("name", sorted(SLIME_ACTORS))
def test_slime_reads_a_routed_expert_teacher_as_the_converter_does(tmp_path, name):
    """issue 64: the route decision read experts as num_experts / num_local_experts only; DeepSeek-V3
    and GLM-4.5 write n_routed_experts, so their own actor saw a dense teacher ("num_experts: teacher
    0, actor 256") and MLA's widths went uncompared. Now the converter's HFArchitecture is compared."""
    root = str(published_checkpoint(name, tmp_path))
    actor = SLIME_ACTORS[name]
    assert hf_teachers.local_loading(root, actor, WHAT) == (hf_teachers.SNAPSHOT, [])
    experts = _text(name)["n_routed_experts"]
    dense = Namespace(**{**vars(actor), "num_experts": None})
    route, differences = hf_teachers.local_loading(root, dense, WHAT)
    assert route == hf_teachers.HF and f"num_experts: teacher {experts}, actor 0" in differences
    interleaved = Namespace(**{**vars(actor), "moe_layer_freq": 2})
    assert hf_teachers.local_loading(root, interleaved, WHAT) == \
        (hf_teachers.HF, ["first_k_dense_replace: teacher 3, actor --moe-layer-freq 2"])


def test_slime_compares_multi_latent_attentions_widths(tmp_path):
    root = str(published_checkpoint("DeepSeek-V3", tmp_path))
    actor = SLIME_ACTORS["DeepSeek-V3"]
    narrower = Namespace(**{**vars(actor), "kv_lora_rank": 256, "q_lora_rank": None})
    assert hf_teachers.local_loading(root, narrower, WHAT) == \
        (hf_teachers.HF, ["q_lora_rank: teacher 1536, actor 0", "kv_lora_rank: teacher 512, actor 256"])
    plain = Namespace(**{**vars(actor), "multi_latent_attention": False, "qk_layernorm": False})
    assert hf_teachers.local_loading(root, plain, WHAT) == \
        (hf_teachers.HF, ["qk_norm: teacher True, actor False", "multi_latent_attention: teacher True, actor False"])
