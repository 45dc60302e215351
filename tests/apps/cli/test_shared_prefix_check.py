"""`megatron-rl-patches shared-prefix check` (issue 119 item 5): from a model's config and a layout alone,
per framework and per pass, "shared", "packed whole, because ..." or "refused, because ...", with the flag
to change in that framework's words. A tiny DeepSeek-V3-shaped config.json (the published field names)
at TP = 2, CP = 2, PP = 2, EP = 8 under each framework; a slime run script's Megatron flags; bad input
named, exit code 2."""
from __future__ import annotations

import json

import pytest

from megatron_rl_patches.apps import cli

DEEPSEEK_V3 = {  # DeepSeek-V3's config.json fields, at toy sizes
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
    "num_hidden_layers": 4, "num_attention_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 48,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1, "topk_method": "noaux_tc",
    "num_nextn_predict_layers": 1, "vocab_size": 256, "attention_dropout": 0.0,
    "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096},
}
LAYOUT = ["--tp", "2", "--cp", "2", "--pp", "2", "--ep", "8"]


def _check(capsys, *argv: str) -> tuple[int, dict]:
    code = cli.main(["shared-prefix", "check", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def _said(result: dict, framework: str) -> set[str]:
    return {verdict["said"] for verdict in result["frameworks"][framework]["passes"].values()}


@pytest.fixture
def deepseek(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    return str(tmp_path)


def test_deepseek_v3_at_tp2_cp2_pp2_ep8_under_each_framework(capsys, deepseek, clean_patch_state):
    code, result = _check(capsys, "--hf-config", deepseek, *LAYOUT)
    assert code == 1 and result["kinds"] == ["multi-latent attention", "MTP depth 1", "MoE (8 experts)"]
    assert list(result["frameworks"]) == ["slime", "verl", "nemo-rl", "megatron"]
    assert len(result["frameworks"]["slime"]["passes"]) == 4 and len(result["frameworks"]["verl"]["passes"]) == 3
    for framework, change in (("slime", "(to share: --no-rope-fusion)"),
                              ("verl", "(to share: +actor_rollout_ref.actor.megatron.override_transformer_config."
                                       "apply_rope_fusion=False)"),
                              ("nemo-rl", "policy.megatron_cfg.apply_rope_fusion=false")):
        (said,) = _said(result, framework)  # every pass alike
        assert said.startswith("packed whole, because ") and "multi-latent attention with fused" in said, said
        assert change in said, (framework, said)
        assert "apply_rope_fusion=False)" not in said or framework == "verl"  # slime's words, not the field's
    assert "policy.megatron_cfg.pipeline_model_parallel_size=1" in _said(result, "nemo-rl").pop()
    (loop,) = _said(result, "megatron")
    assert loop.startswith("refused, because pipeline parallelism without variable_seq_lengths")

    code, result = _check(capsys, "--hf-config", deepseek, *LAYOUT, "--set", "apply_rope_fusion=False")
    assert _said(result, "slime") == _said(result, "verl") == {"shared"}
    assert "shared" not in _said(result, "nemo-rl") and code == 1
    code, _ = _check(capsys, "--hf-config", deepseek, "--tp", "2", "--ep", "8", "--framework", "verl", "--set",
                     "apply_rope_fusion=False")
    assert code == 0


def test_under_strict_packed_whole_reads_refused(capsys, deepseek, clean_patch_state):
    _, result = _check(capsys, "--hf-config", deepseek, "--framework", "slime", "--strict")
    (said,) = _said(result, "slime")
    assert said.startswith("refused, because multi-latent attention") and "--no-rope-fusion" in said


def test_the_text_report_says_each_pass_once_per_verdict(capsys, deepseek, clean_patch_state):
    cli.main(["shared-prefix", "check", "--hf-config", deepseek, *LAYOUT, "--framework", "slime"])
    text = capsys.readouterr().out
    assert "layout: TP = 2, CP = 2, PP = 2, EP = 8" in text
    assert "  training step, old log-probs, reference log-probs, in-process teachers: packed whole, because" in text


SCRIPT = """# slime's run-qwen3-next-80B-A3B.sh, its Megatron flags
PERF_ARGS=(
   --tensor-model-parallel-size 2 --sequence-parallel \\
   --pipeline-model-parallel-size 1 --context-parallel-size 2 \\
   --expert-model-parallel-size 8 --num-experts 8 --moe-router-enable-expert-bias \\
   --moe-router-bias-update-rate 0 --lr 1e-6 --micro-batch-size 1
)
--spec "slime_plugins.models.qwen3_next" "get_qwen3_next_spec"
"""


def test_a_slime_run_scripts_flags(capsys, tmp_path, clean_patch_state):
    script = tmp_path / "qwen3-next.args"
    script.write_text(SCRIPT)
    code, result = _check(capsys, "--megatron-args", str(script))
    assert result["kinds"] == ["MoE (8 experts)", "gated delta nets"]
    assert result["layout"]["tp"] == 2 and result["layout"]["cp"] == 2 and result["layout"]["sp"] is True
    assert _said(result, "slime") == {"shared"}  # slime's own gated delta net layers, at CP too
    (verl,) = _said(result, "verl")  # megatron-core's gated delta net, not cut over CP ranks
    assert "context parallelism beside megatron-core's gated delta net" in verl and "context_parallel_size=1" in verl
    (nemo,) = _said(result, "nemo-rl")
    assert "megatron-core 0.20's rewritten gated delta net" in nemo
    script.write_text(SCRIPT + "--use-rollout-routing-replay\n")
    _, result = _check(capsys, "--megatron-args", str(script), "--framework", "slime")
    (said,) = _said(result, "slime")
    assert "drop --use-rollout-routing-replay and --use-routing-replay" in said and code == 1


def test_a_vision_language_model_packs_whole_everywhere(capsys, tmp_path, clean_patch_state):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {},
                                                      "text_config": {"hidden_size": 64}}))
    _, result = _check(capsys, "--hf-config", str(tmp_path))
    for framework in ("slime", "verl", "nemo-rl"):
        (said,) = _said(result, framework)
        assert said.startswith("packed whole, because a vision-language model's prompt") and "switch the setting off" \
            in said


@pytest.mark.parametrize(("argv", "words"), [
    (["--hf-config", "{missing}"], "no config.json there"),
    (["--hf-config", "{tmp}", "--set", "apply_rope_fusion"], "write FIELD=VALUE"),
    (["--hf-config", "{tmp}", "--tp", "0"], "--tp 0: a parallel size is 1 or more"),
    (["--megatron-args", "{args}"], "--num-experts takes a value"),
    (["--hf-config", "{tmp}", "--framework", "deepspeed"], "invalid choice: 'deepspeed'"),
])
def test_bad_input_is_named_with_exit_code_2(capsys, tmp_path, clean_patch_state, argv, words):
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    (tmp_path / "bad.args").write_text("--num-experts\n")
    paths = {"missing": str(tmp_path / "nowhere"), "tmp": str(tmp_path), "args": str(tmp_path / "bad.args")}
    code = cli.main(["shared-prefix", "check", *(word.format(**paths) for word in argv)])
    assert code == 2 and words in capsys.readouterr().err
