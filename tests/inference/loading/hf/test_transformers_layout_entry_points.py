"""Qwen3.5 directories as transformers 5's save_pretrained writes them (`save_tiny_hf`: the text model
under `text_config`, weights under `model.language_model.*`) and as the test kit writes them without
transformers (`transformers_layout`: what the slime lane's Qwen3.5 directories use), through every
entry point (issue 55 item 1): `check_teacher_vocab`, the builder's vocab, `memory --hf` (weights
present: counted against the config), slime's route and vocabulary check, doctor's teacher check;
and the builder in the checkpoint's own dtype where only the text model names it (Qwen3.5-27B's card)."""
from __future__ import annotations

import json
from argparse import Namespace

import pytest
import torch

from megatron_rl_patches.inference.build_hf import hf_vocab_size
from megatron_rl_patches.inference.loading.hf import (
    UnsupportedCheckpointError,
    check_teacher_vocab,
    hf_memory_plan,
    read_architecture,
)
from megatron_rl_patches.integrations.megatron.opd import hf_teachers
from megatron_rl_patches.integrations.megatron.opd.opd_settings import TEACHERS
from megatron_rl_patches.testing.hf_checkpoints import (
    save_tiny_hf,
    tiny_hf_config,
    transformers_layout,
    write_tiny_checkpoint,
)

VOCAB = 1001  # tiny_hf_config's
# megatron-core < 0.16 has no TransformerConfig.attention_output_gate: the builder refuses Qwen3.5 by
# name there (after every vocabulary check, which is what these tests are about).
OLD_CORE_REFUSAL = r"attention_output_gate \(0\.16\.1 and 0\.19\.2"


def _core_serves_qwen3_5() -> bool:
    from dataclasses import fields

    from megatron.core.transformer.transformer_config import TransformerConfig

    return "attention_output_gate" in {f.name for f in fields(TransformerConfig)}


ACTOR = Namespace(hidden_size=32, num_layers=2, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
                  kv_channels=16, ffn_hidden_size=48, num_experts=None, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> a Qwen3.5 directory in transformers' layout: saved by transformers, written by the
    kit without it."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("layouts")
    save_tiny_hf(root / "transformers", "qwen3_5")
    write_tiny_checkpoint(root / "kit", transformers_layout(tiny_hf_config("qwen3_5")))
    return {name: root / name for name in ("transformers", "kit")}


@pytest.mark.parametrize("name", ["transformers", "kit"])
def test_every_entry_point_reads_the_nested_text_model(checkpoints, clean_patch_state, name):
    root = checkpoints[name]
    config = json.loads((root / "config.json").read_text())
    assert "vocab_size" not in config and config["text_config"]["vocab_size"] == VOCAB  # transformers' layout
    what = f"{TEACHERS}: teacher {str(root)!r}"
    assert check_teacher_vocab(root, VOCAB) == VOCAB
    assert check_teacher_vocab(root, root) == VOCAB
    assert hf_vocab_size(root) == VOCAB == read_architecture(root).vocab_size
    assert hf_memory_plan(root).total_params > 0  # the weight files checked against config.json
    assert hf_teachers.check_vocab(str(root), VOCAB, what) == VOCAB
    route, differences = hf_teachers.local_loading(str(root), ACTOR, what)
    assert route == hf_teachers.HF and "num_hidden_layers: teacher 4, actor 2" in differences
    from megatron_rl_patches.apps.cli.doctor import teacher_problems

    clean_patch_state.setenv(TEACHERS, str(root))
    assert teacher_problems() == []


@pytest.mark.megatron
def test_the_builder_takes_the_text_models_dtype_where_the_wrapper_names_none(megatron_cpu, checkpoints, tmp_path):
    """Qwen3.5-27B's config.json names bfloat16 in its text_config only: built in float32 before."""
    import shutil

    from megatron_rl_patches import build_inference_model_from_hf

    card = tmp_path / "card"
    shutil.copytree(checkpoints["kit"], card)
    config = json.loads((card / "config.json").read_text())
    config.pop("dtype")
    config["text_config"]["dtype"] = "bfloat16"
    (card / "config.json").write_text(json.dumps(config))
    if not _core_serves_qwen3_5():
        with pytest.raises(UnsupportedCheckpointError, match=OLD_CORE_REFUSAL):
            build_inference_model_from_hf(card)
        return
    (chunk,) = build_inference_model_from_hf(card)
    assert {p.dtype for p in chunk.parameters()} == {torch.bfloat16}


@pytest.mark.megatron
def test_slimes_hf_teacher_builds_a_qwen3_5_directory_as_transformers_writes_it(megatron_cpu, checkpoints):
    """slime's Hugging Face teacher path (`prm_teacher`, OPD teachers without `;tokenizer=own`) stopped
    at its vocabulary check on this layout before building."""
    root = str(checkpoints["kit"])
    args = Namespace(params_dtype=torch.float32, make_vocab_size_divisible_by=128, transformer_impl="local")
    if not _core_serves_qwen3_5():  # past the vocabulary check, refused by the builder by name
        with pytest.raises(UnsupportedCheckpointError, match=OLD_CORE_REFUSAL):
            hf_teachers.build_hf_teacher(args, root, None, VOCAB, None, f"{TEACHERS}: teacher {root!r}")
        return
    (chunk,) = hf_teachers.build_hf_teacher(args, root, None, VOCAB, None, f"{TEACHERS}: teacher {root!r}")
    assert chunk.hf_vocab_size == VOCAB and chunk.embedding.word_embeddings.weight.shape[0] == 1024
