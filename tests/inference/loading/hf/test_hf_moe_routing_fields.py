"""MoE routing fields of config.json that reached megatron-core's assertion, a ZeroDivisionError,
a build transformers refuses or a first forward that fails (issue 55 item 3): each refused by the one
architecture reader, naming config.json's field and what is valid, so the build and `memory --hf`
agree; nothing is built first."""
from __future__ import annotations

import json

import pytest
from kit.cli import run_memory_cli

from megatron_rl_patches.inference.loading.hf.families import architecture
from megatron_rl_patches.inference.loading.hf.families.sigmoid_router import SigmoidRouter
from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config

# (family, overrides, what the ValueError says): tiny glm4_moe / deepseek_v3 route 8 experts in 4 groups
CASES = [
    ("glm4_moe", {"n_group": 3}, "n_group=3 does not divide n_routed_experts=8"),
    ("deepseek_v3", {"n_group": 3}, "n_group=3 does not divide n_routed_experts=8"),
    ("glm4_moe", {"topk_group": 0}, "topk_group must be a positive integer, got 0"),
    ("deepseek_v3", {"topk_group": 0}, "topk_group must be a positive integer, got 0"),
    ("glm4_moe", {"topk_group": 5}, "topk_group=5 exceeds n_group=4"),
    ("deepseek_v3", {"topk_group": 5}, "topk_group=5 exceeds n_group=4"),
    ("deepseek_v3", {"model_type": "kimi_k2", "topk_group": 5}, "topk_group=5 exceeds n_group=4"),
    ("deepseek_v3", {"routed_scaling_factor": "x"}, "routed_scaling_factor must be a positive number, got 'x'"),
    ("glm4_moe", {"routed_scaling_factor": 0}, "routed_scaling_factor must be a positive number, got 0"),
    ("mixtral", {"num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds num_local_experts=4"),
    ("qwen2_moe", {"shared_expert_intermediate_size": -1}, "shared_expert_intermediate_size must be an integer >= 0"),
    ("glm4_moe", {"n_shared_experts": "1"}, "n_shared_experts must be an integer >= 0, got '1'"),
    # one field under two names transformers' config class maps as one (which wins differs by class)
    ("mixtral", {"num_experts": 3}, "writes num_local_experts=4, num_experts=3: transformers reads these as one"),
    ("deepseek_v3", {"num_local_experts": 4}, "writes n_routed_experts=8, num_local_experts=4"),
]
IDS = [f"{kind}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for kind, o, _ in CASES]


def _config_dir(folder, kind, **overrides):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**tiny_hf_config(kind), **overrides}))
    return folder


@pytest.mark.parametrize(("kind", "overrides", "says"), CASES, ids=IDS)
def test_the_architecture_reader_names_the_field(kind, overrides, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(")) as caught:
        architecture(tiny_hf_config(kind, **overrides))
    assert "config.json" in str(caught.value).partition(': ')[2]


@pytest.mark.parametrize(("kind", "overrides", "says"), CASES, ids=IDS)
def test_memory_hf_exits_2_naming_the_field(tmp_path, capsys, kind, overrides, says):
    """It planned them (exit 0), or printed a ZeroDivisionError traceback (topk_group 0)."""
    code, out, err = run_memory_cli(["--hf", str(_config_dir(tmp_path, kind, **overrides))], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1 and says in err, err


@pytest.mark.megatron
@pytest.mark.parametrize(("kind", "overrides", "says"), [c for c in CASES if c[0] in ("glm4_moe", "mixtral")],
                         ids=[i for i, c in zip(IDS, CASES) if c[0] in ("glm4_moe", "mixtral")])
def test_the_build_refuses_before_building(megatron_cpu, no_build, tmp_path, kind, overrides, says):
    """n_group 3 reached megatron-core's AssertionError; num_experts_per_tok 5 of 4 built, then the
    first forward failed (selected index k out of range)."""
    from megatron_rl_patches import build_inference_model_from_hf
    from megatron_rl_patches.testing.hf_checkpoints import write_tiny_checkpoint

    write_tiny_checkpoint(tmp_path, tiny_hf_config(kind))
    _config_dir(tmp_path, kind, **overrides)
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        build_inference_model_from_hf(tmp_path)


def test_a_field_under_its_other_name_is_read():
    """transformers 5 saves Qwen3-MoE's expert count as num_local_experts."""
    config = tiny_hf_config("qwen3_moe")
    config["num_local_experts"] = config.pop("num_experts")
    assert architecture(config).num_experts == 4


def test_valid_groups_still_read():
    arch = architecture(tiny_hf_config("glm4_moe", n_group=8, topk_group=8, num_experts_per_tok=2))
    assert (arch.sigmoid_router.groups, arch.sigmoid_router.group_topk) == (8, 8)
    arch = architecture(tiny_hf_config("glm4_moe", n_group=None, topk_group=None, routed_scaling_factor=None))
    assert arch.sigmoid_router == SigmoidRouter(groups=1, group_topk=1, scaling=1.0)
    assert architecture(tiny_hf_config("qwen3_moe")).sigmoid_router is None  # the top-k softmax router


@pytest.fixture
def fused_processors(clean_patch_state):
    import megatron_rl_patches

    megatron_rl_patches.apply(only="gpt_output_processor")  # `native` on >= 0.18


@pytest.mark.megatron
@pytest.mark.usefixtures("transformers", "moe_router_on_cpu", "fused_processors")
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_top1_routing_equals_transformers(megatron_cpu, tmp_path, kind):
    """Refused with "Please use --moe-router-pre-softmax when topk is 1", a Megatron-LM flag: the one
    expert's weight is 1 (softmax over its logit, renormalized), as transformers' forward computes."""
    import torch
    from kit.hf_scores import built_log_probs, transformers_log_probs

    from megatron_rl_patches import build_inference_model_from_hf
    from megatron_rl_patches.testing.hf_checkpoints import router_margin, save_tiny_hf
    from megatron_rl_patches.testing.megatron_cpu import make_batch

    model = save_tiny_hf(tmp_path, kind, seed=3, num_experts_per_tok=1)
    batch = make_batch(batch_size=2, seq_length=12, vocab_size=1001, seed=0)
    assert router_margin(model, batch["tokens"]) > 1e-3
    want = transformers_log_probs(model, batch)
    got = built_log_probs(build_inference_model_from_hf(tmp_path, dtype=torch.float32)[0], batch, 1001)
    assert (got - want).abs().max().item() < 1e-5
