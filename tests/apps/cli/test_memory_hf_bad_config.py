"""`memory --hf` on config.json defects (issue 49): each exits 2 with one line naming the field
(no traceback, no MemoryError), the splits the builder refuses are refused by the same check, and
a feature that changes no byte (RoPE scaling: Llama-3.1's llama3, Qwen's YaRN) is sized, not refused."""
import json

import pytest

from megatron_rl_patches.apps.cli import main
from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint


def _run(argv, capsys):
    code = main(["memory", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _config_dir(folder, kind="qwen3", **overrides):
    """`folder` holding a config.json only (no weights): tiny_hf_config(kind) with `overrides` (None: deleted)."""
    folder.mkdir(exist_ok=True)
    config = {k: v for k, v in {**tiny_hf_config(kind), **overrides}.items() if v is not None}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(("overrides", "names"), [
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
    ({"rope_parameters": [1]}, "rope_parameters must be an object"),
    ({"rope_parameters": None, "rope_theta": "1e6"}, "rope_theta"),
    ({"model_type": ["qwen3"]}, "model_type ['qwen3']"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
])
def test_field_types_exit_2_naming_the_field(tmp_path, capsys, overrides, names):
    code, out, err = _run(["--hf", str(_config_dir(tmp_path, **overrides))], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1 and names in err, err


def test_more_experts_per_token_than_experts(tmp_path, capsys):
    code, _, err = _run(["--hf", str(_config_dir(tmp_path, "qwen3_moe", num_experts_per_tok=9))], capsys)
    assert code == 2 and "num_experts_per_tok=9 exceeds num_experts=4" in err


@pytest.mark.parametrize(("argv", "says"), [
    (["--tp", "3"], "num_key_value_heads=2 is not a multiple of the tensor-parallel size 3"),
    (["--pp", "2"], "num_hidden_layers=3 is not a multiple of the pipeline-parallel size 2"),
])
def test_splits_the_builder_refuses_are_refused(tmp_path, capsys, argv, says):
    """They printed a plan (exit 0) with rounded-up counts."""
    root = _config_dir(tmp_path, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    code, out, err = _run(["--hf", str(root), *argv], capsys)
    assert code == 2 and out == "" and says in err, err


def test_huge_counts_are_counted_not_listed(tmp_path, capsys):
    """config.json alone: 10**9 layers is arithmetic (it was a growing MemoryError); beside weight files
    that hold 3 layers, the count is named."""
    code, out, _ = _run(["--hf", str(_config_dir(tmp_path / "alone", num_hidden_layers=10**9)), "--json"], capsys)
    assert code == 0 and json.loads(out)["hf_plan"]["layers_per_stage"] == 10**9
    write_tiny_checkpoint(tmp_path / "weights", tiny_hf_config("qwen3"))
    config = json.loads((tmp_path / "weights" / "config.json").read_text())
    (tmp_path / "weights" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**9}))
    code, out, err = _run(["--hf", str(tmp_path / "weights")], capsys)
    assert code == 2 and "num_hidden_layers=1000000000 but the checkpoint holds" in err


@pytest.mark.parametrize("rope", [{"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
                                  {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}])
def test_rope_scaling_is_sized_like_plain_rope(tmp_path, capsys, rope):
    """Llama-3.1-8B exited 2 (a usage error) for a feature that changes no byte."""
    plain = _run(["--hf", str(_config_dir(tmp_path / "plain", "llama")), "--json"], capsys)
    scaled = _run(["--hf", str(_config_dir(tmp_path / "scaled", "llama", **rope)), "--json"], capsys)
    assert plain[0] == scaled[0] == 0
    assert json.loads(scaled[1])["hf_plan"]["gpu_params"] == json.loads(plain[1])["hf_plan"]["gpu_params"]
