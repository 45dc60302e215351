"""`megatron-rl-patches memory --hf PATH`: per-GPU weights of a Hugging Face checkpoint's
inference-only build at TP / PP / EP by residency mode, from its config.json alone; the numbers
against counts made by hand here (Qwen3-30B-A3B's published config: 30.5B parameters, 3.3B active)."""
import json

import pytest

from megatron_rl_patches.apps.cli import main
from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config

QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False, rms_norm_eps=1e-6,
    max_position_embeddings=40960, rope_theta=1000000.0, hidden_act="silu",
)


def _run(argv, capsys):
    code = main(["memory", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def qwen3_30b(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    return tmp_path


def test_moe_counts_by_hand(qwen3_30b, capsys):
    h, vocab, layers = 2048, 151936, 48
    attention = 4096 * h + 2 * 512 * h + h * 4096  # q, k, v (4 kv heads of 128), o
    small = 2 * h + 2 * 128  # the two layer norms, q_norm and k_norm
    router, expert = 128 * h, 3 * h * 768
    total = 2 * vocab * h + h + layers * (attention + small + router + 128 * expert)
    active = total - layers * (128 - 8) * expert
    assert (total, active) == (30_532_122_624, 3_353_032_704)  # the published 30.5B / 3.3B

    code, out, err = _run(["--hf", str(qwen3_30b), "--tp", "4", "--pp", "4", "--ep", "8", "--json"], capsys)
    assert code == 0 and err == ""
    plan = json.loads(out)["hf_plan"]
    assert plan["total_params"] == total and plan["active_params"] == active
    padded = 152064  # 151936 up to a multiple of 128 x TP = 512
    assert plan["padded_vocab"] == padded
    layer = attention // 4 + small + router + (128 // 8) * (expert // 4)  # experts over EP, each over TP
    assert plan["layer_params"] == layer and plan["layers_per_stage"] == 12
    first, last = 12 * layer + padded // 4 * h, 12 * layer + padded // 4 * h + h
    assert plan["stage_params"] == [first, 12 * layer, 12 * layer, last] and plan["gpu_params"] == last
    modes = plan["modes"]
    assert modes["resident"] == {"mode": "resident", "device_peak": 2 * last, "device_between_phases": 2 * last,
                                 "host": 0}
    assert modes["swap"]["device_peak"] == modes["swap"]["host"] == 2 * last
    assert modes["stream"]["device_peak"] == 2 * (2 * layer + padded // 4 * h + h)  # 2 layers + the output layer
    assert json.loads(out)["num_params"] == last  # the training-state table is for one GPU's shard


def test_table(qwen3_30b, capsys):
    code, out, _ = _run(["--hf", str(qwen3_30b), "--tp", "4", "--ep", "8", "--residency", "stream"], capsys)
    assert code == 0
    assert "(qwen3_moe): 30,532,122,624 parameters, 3,353,032,704 active per token; vocab padded to 152,064" in out
    assert "Per GPU at TP=4 PP=1 EP=8 (bf16)" in out
    assert "* stream" in out and "  resident" in out
    assert "Per data-parallel rank:" in out  # the trainable build's extra state for the same shard


def test_dense_tied_single_stage(tmp_path, capsys):
    """A tied output layer at PP=1 is the embedding itself: counted once."""
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config("llama", tie_word_embeddings=True)))
    code, out, _ = _run(["--hf", str(tmp_path), "--json", "--param-dtype", "fp32"], capsys)
    plan = json.loads(out)["hf_plan"]
    layer = 32 * 32 * 2 + 2 * 16 * 32 + 3 * 32 * 48 + 2 * 32  # q, o; k, v; mlp; norms
    assert plan["total_params"] == plan["active_params"] == 1001 * 32 + 2 * layer + 32
    assert plan["stage_params"] == [1024 * 32 + 2 * layer + 32]
    assert plan["modes"]["resident"]["device_peak"] == 4 * plan["stage_params"][0]


@pytest.mark.parametrize(("argv", "message"), [
    (["--hf", "/nonexistent/dir"], "does not exist"),
    (["--params", "7B", "--pp", "2"], "--pp and --ep need --hf"),
    (["--params", "7B", "--hf", "x"], "one of them"),
])
def test_usage_errors(capsys, argv, message):
    code, out, err = _run(argv, capsys)
    assert code == 2 and out == "" and message in err


def test_layouts_that_do_not_fit(qwen3_30b, tmp_path, capsys):
    code, _, err = _run(["--hf", str(qwen3_30b), "--ep", "3"], capsys)
    assert code == 2 and "128 experts are not a multiple of the expert-parallel size 3" in err
    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "config.json").write_text(json.dumps(tiny_hf_config("qwen3")))
    code, _, err = _run(["--hf", str(tmp_path / "dense"), "--ep", "2"], capsys)
    assert code == 2 and "expert-parallel size 2 with a dense model" in err
