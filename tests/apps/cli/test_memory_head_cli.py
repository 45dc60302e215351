"""`megatron-rl-patches memory --head DIR [--tp N]`: a served teacher's output layer's bytes per
rank on the trainer, from config.json and the tensor index alone, against the bytes
`TeacherHead.from_hf` really holds: at TP=1, and at TP=2 in a real 2-rank gloo world (every rank's
shard); text and JSON, beside --hf, and the refusals."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_rl_patches.apps.cli import main
from megatron_rl_patches.testing.multirank import run_multirank

pytest.importorskip("transformers")

from megatron_rl_patches.teachers import TeacherHead  # noqa: E402
from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf  # noqa: E402


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("memory-heads")
    save_tiny_hf(root / "untied", "qwen3", seed=1)
    save_tiny_hf(root / "tied", "qwen3", seed=2, tie_word_embeddings=True)
    return root


def _json(argv, capsys):
    assert main(["memory", *argv, "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return json.loads(out)


def _tp2_heads(rank, world, root):
    """Each rank's real head shard at TP=2 (the whole world is the tensor-parallel group)."""
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    return {name: TeacherHead.from_hf(f"{root}/{name}", tp_group=group, dtype=dtype).nbytes
            for name, dtype in (("untied", None), ("tied", torch.bfloat16))}


def test_bytes_equal_the_loaded_heads(heads, capsys):
    untied, tied = str(heads / "untied"), str(heads / "tied")
    rows = _json(["--head", untied, "--head", tied], capsys)["teacher_heads"]
    # TP=1: padded as the student's vocabulary (1001 -> 1024, a multiple of 128), as from_hf(tp_group=...) pads it
    assert [r["bytes_per_rank"] for r in rows] == [TeacherHead.from_hf(untied, make_vocab_size_divisible_by=128).nbytes,
                                                   TeacherHead.from_hf(tied, make_vocab_size_divisible_by=128).nbytes]
    assert rows[0]["bytes_per_rank"] == 1024 * 32 * 4 and rows[0]["tensor"] == "lm_head.weight"
    assert rows[1]["tensor"] == "model.embed_tokens.weight"  # tied: the embedding is the head
    # TP=2: the vocabulary padded to 1024 (a multiple of 128 x 2), 512 rows per rank
    per_rank = run_multirank(_tp2_heads, 2, str(heads), timeout=300)
    two = _json(["--head", untied, "--head", tied, "--tp", "2", "--head-dtype", "bfloat16"], capsys)["teacher_heads"]
    one = _json(["--head", untied, "--tp", "2"], capsys)["teacher_heads"][0]
    assert one["bytes_per_rank"] == 512 * 32 * 4 and one["padded_vocab_size"] == 1024
    for shard in per_rank:
        assert shard["untied"] == one["bytes_per_rank"]
        assert shard["tied"] == two[1]["bytes_per_rank"] == 512 * 32 * 2


def test_text_and_beside_hf(heads, capsys):
    untied = str(heads / "untied")
    assert main(["memory", "--head", untied, "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert untied in out and "lm_head.weight" in out and "64.00 KiB" in out and "512" in out
    both = _json(["--hf", untied, "--tp", "2", "--head", untied], capsys)
    assert both["hf_plan"]["padded_vocab"] == both["teacher_heads"][0]["padded_vocab_size"] == 1024
    assert main(["memory", "--hf", untied, "--head", untied]) == 0
    out = capsys.readouterr().out
    assert out.index("qwen3") < out.index("teacher head")  # the plan, then the heads


@pytest.mark.parametrize("argv, words", [
    (["--head-dtype", "bfloat16", "--params", "1B"], "--head DIR"),
    (["--head", "{missing}"], "--head"),
    (["--head", "{untied}", "--layers", "4"], "--layers"),
])
def test_refusals(heads, argv, words, capsys):
    argv = [a.format(untied=heads / "untied", missing=heads / "missing") for a in argv]
    assert main(["memory", *argv]) != 0
    err = capsys.readouterr().err
    assert words in err


def test_the_cli_offers_the_head_dtypes_the_head_takes():
    from megatron_rl_patches.apps.cli.memory import HEAD_DTYPES
    from megatron_rl_patches.teachers.head.teacher_head import DTYPES

    assert set(HEAD_DTYPES) == set(DTYPES)
