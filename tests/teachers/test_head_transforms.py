"""The engine's logits transforms through `TeacherHead.from_hf` (`teachers.head.transforms`): one
config.json per row of the table, the head's log-probs against a float64 reference of the formula
vLLM 0.32 applies after the states it pools (`LogitsProcessor(scale=...)` in each model file), or
the refusal naming the field. Small checkpoints written here: config.json and lm_head.weight."""
from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_rl_patches.teachers import TeacherHead
from megatron_rl_patches.teachers.head.transforms import (
    APPLIED,
    EITHER,
    HEAD_TRANSFORMS,
    IN_STATES,
    OUTER,
    REFUSED,
    TEXT,
)
from megatron_rl_patches.testing.hf_checkpoints import write_safetensors

V, H = 96, 16


def checkpoint(tmp_path, architecture: str, bias: bool = False, **fields):
    """A directory holding config.json (`fields` on top of the sizes) and a random lm_head.weight."""
    weight = torch.randn(V, H, generator=torch.Generator().manual_seed(7), dtype=torch.float64).float()
    root = tmp_path / architecture
    root.mkdir()
    config = {"architectures": [architecture], "model_type": architecture.lower(), "vocab_size": V, "hidden_size": H,
              "torch_dtype": "float32", **fields}
    (root / "config.json").write_text(json.dumps(config))
    tensors = {"lm_head.weight": weight}
    if bias:
        tensors["lm_head.bias"] = torch.zeros(V)
    write_safetensors(root / "model.safetensors", tensors)
    return root, weight


def engine_log_probs(hidden, weight, scale: float, tau: float) -> torch.Tensor:
    """vLLM's logits (h·Wᵀ, then × scale) at temperature tau, log-softmax in float64."""
    return torch.log_softmax(hidden.double() @ weight.double().T * scale / tau, dim=-1)


APPLIED_CASES = [  # (architecture, fields, the engine's scale written as its model file computes it)
    ("LlamaForCausalLM", {"logit_scale": 0.5}, 0.5),
    ("NemotronForCausalLM", {"logit_scale": 1.75}, 1.75),
    ("CohereForCausalLM", {}, 0.0625),  # transformers' CohereConfig default, which vLLM reads
    ("Cohere2ForCausalLM", {"logit_scale": 0.125}, 0.125),
    ("GraniteForCausalLM", {"logit_scale": 2.0, "logits_scaling": 8.0}, 2.0 / 8.0),
    ("GraniteMoeHybridForCausalLM", {"logits_scaling": 6.0}, 1 / 6.0),
    ("HyperCLOVAXForCausalLM", {"logit_scale": 0.5, "logits_scaling": 3.0}, 0.5 * 3.0),
    ("FalconH1ForCausalLM", {"lm_head_multiplier": 0.0390625}, 0.0390625),
    ("TeleFLMForCausalLM", {"use_mup": True, "output_mult": 3.0, "mup_scale_factor": 2.5}, 3.0 / 2.5),
    ("TeleFLMForCausalLM", {"use_mup": False, "output_mult": 3.0, "mup_scale_factor": 2.5}, 1.0),
    # MiniCPM divides the states by hidden_size / dim_model_base inside its forward: the pooled
    # states carry it, the logits get no scale
    ("MiniCPMForCausalLM", {"dim_model_base": 4, "scale_emb": 12, "scale_depth": 1.4}, 1.0),
]


@pytest.mark.parametrize("architecture, fields, scale", APPLIED_CASES,
                         ids=[f"{a}-{'-'.join(f) or 'default'}" for a, f, _ in APPLIED_CASES])
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_an_engine_scale_is_applied_in_the_head(tmp_path, architecture, fields, scale, tau):
    root, weight = checkpoint(tmp_path, architecture, **fields)
    hidden = torch.randn(12, H, generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(2))
    want = engine_log_probs(hidden, weight, scale, tau)
    for dtype, tol in (("float64", 1e-12), (None, 1e-5)):
        head = TeacherHead.from_hf(root, dtype=dtype)
        assert head.logit_scale == pytest.approx(scale, rel=1e-15)
        got = head.token_log_probs(hidden, tokens, temperature=tau)
        torch.testing.assert_close(got.double(), want.gather(1, tokens[:, None])[:, 0], atol=tol, rtol=0)
        ids, values, tail = head.topk(hidden, 8, temperature=tau)
        assert torch.equal(ids, want.topk(8, dim=-1).indices)
        torch.testing.assert_close(values.double(), want.gather(1, ids), atol=tol, rtol=0)
        rest = want.clone().scatter_(1, ids, -math.inf).logsumexp(-1)
        torch.testing.assert_close(tail.double(), rest, atol=tol * 10, rtol=0)


REFUSED_CASES = [  # (architecture, fields, a bias tensor, the field named)
    ("Gemma2ForCausalLM", {}, False, "final_logit_softcapping=30.0"),  # transformers' default cap
    ("Gemma3ForCausalLM", {"final_logit_softcapping": 30.0}, False, "final_logit_softcapping"),
    ("Gemma3nForCausalLM", {}, False, "final_logit_softcapping=30.0"),
    ("MuseGlimmerForCausalLM", {"output_multiplier": 0.2, "final_logit_softcapping": None}, False,
     "final_logit_softcapping=20.0"),
    ("GPTJForCausalLM", {}, True, "lm_head.bias"),
    ("Qwen3ForCausalLM", {"logit_scale": 0.5}, False, "logit_scale=0.5.*not known for Qwen3ForCausalLM"),
    ("Qwen3ForCausalLM", {"lm_head_multiplier": 2.0}, False, "lm_head_multiplier"),
    ("FalconH1ForCausalLM", {"lm_head_multiplier": 0.0}, False, "lm_head_multiplier=0.0.*non-zero"),
    ("TeleFLMForCausalLM", {"use_mup": True, "output_mult": 3.0}, False, "mup_scale_factor=None"),
]


@pytest.mark.parametrize("architecture, fields, bias, named", REFUSED_CASES,
                         ids=[f"{a}-{'-'.join(f) or 'default'}" for a, f, _, _ in REFUSED_CASES])
def test_a_transform_the_head_cannot_form_is_refused_by_name(tmp_path, architecture, fields, bias, named):
    root, _ = checkpoint(tmp_path, architecture, bias=bias, **fields)
    with pytest.raises(ValueError, match=named):
        TeacherHead.from_hf(root)


def nested(tmp_path, architecture: str, outer: dict, text: dict):
    """A wrapper's checkpoint: the sizes in `text_config` (with `text`), `outer` on top."""
    root, weight = checkpoint(tmp_path, architecture, **outer)
    config = json.loads((root / "config.json").read_text())
    config["text_config"] = {"vocab_size": V, "hidden_size": H, **text}
    (root / "config.json").write_text(json.dumps(config))
    return root, weight


WHERE_CASES = [  # (architecture, config.json's own fields, its text_config's, the scale vLLM 0.32 applies)
    # aria.py: `getattr(config, "logit_scale", 1.0)` of the wrapper's hf_config, not its text_config
    ("AriaForConditionalGeneration", {}, {"logit_scale": 0.5}, 1.0),
    ("AriaForConditionalGeneration", {"logit_scale": 0.5}, {"logit_scale": 4.0}, 0.5),
    # llama.py: the hf_config as config.json writes it
    ("LlamaForCausalLM", {"logit_scale": 2.0}, {"logit_scale": 0.5}, 2.0),
    ("LlamaForCausalLM", {}, {"logit_scale": 0.5}, 1.0),
    # granite.py: logit_scale / logits_scaling, both the hf_config's
    ("GraniteForCausalLM", {"logits_scaling": 8.0}, {"logit_scale": 3.0, "logits_scaling": 2.0}, 1 / 8.0),
    # commandr.py: `config.logit_scale`, transformers' default where config.json omits it
    ("CohereForCausalLM", {}, {"logit_scale": 0.5}, 0.0625),
    ("FalconH1ForCausalLM", {"lm_head_multiplier": 0.25}, {"lm_head_multiplier": 4.0}, 0.25),
    # teleflm.py: use_mup and its factors the hf_config's
    ("TeleFLMForCausalLM", {"output_mult": 3.0, "mup_scale_factor": 2.5}, {"use_mup": True}, 1.0),
    # exaone_moe.py: `hf_config.get_text_config()`: the text_config where there is one
    ("ExaoneMoeForCausalLM", {"logit_scale": 2.0}, {"logit_scale": 0.5}, 0.5),
    ("ExaoneMoeForCausalLM", {"logit_scale": 2.0}, {}, 1.0),
]


@pytest.mark.parametrize("architecture, outer, text, scale", WHERE_CASES,
                         ids=[f"{a}-{'-'.join(o) or 'none'}-text-{'-'.join(t) or 'none'}"
                              for a, o, t, _ in WHERE_CASES])
def test_a_scale_is_read_where_the_engine_reads_it(tmp_path, architecture, outer, text, scale):
    root, weight = nested(tmp_path, architecture, outer, text)
    head = TeacherHead.from_hf(root, dtype="float64")
    assert head.logit_scale == pytest.approx(scale, rel=1e-15)
    torch.testing.assert_close(head.weight, weight.double() * scale, atol=1e-12, rtol=0)


def test_exaone_moe_without_a_text_config_reads_its_own_fields(tmp_path):
    root, _ = checkpoint(tmp_path, "ExaoneMoeForCausalLM", logit_scale=2.0)  # get_text_config(): the config itself
    assert TeacherHead.from_hf(root).logit_scale == 2.0


@pytest.mark.parametrize(("architecture", "outer", "text", "named"), [
    ("Qwen3_5ForConditionalGeneration", {}, {"logit_scale": 0.5}, "logit_scale=0.5.*not known for Qwen3_5"),
    ("Gemma3ForConditionalGeneration", {}, {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
])
def test_a_field_refused_is_refused_wherever_it_is_written(tmp_path, architecture, outer, text, named):
    """A refusal reads both configs: refusing a field the engine would not read is safe, serving
    one it reads is not."""
    root, _ = nested(tmp_path, architecture, outer, text)
    with pytest.raises(ValueError, match=named):
        TeacherHead.from_hf(root)


def test_each_applied_row_names_the_config_and_the_vllm_file_it_reads():
    for row in HEAD_TRANSFORMS:
        assert row.reads in (OUTER, TEXT, EITHER), row
        assert row.files and all(name.endswith(".py") for name in row.files), row
    assert {row.reads for row in HEAD_TRANSFORMS if row.action == APPLIED} == {OUTER, TEXT}


def test_neutral_values_and_other_families_are_served_as_they_are(tmp_path):
    root, weight = checkpoint(tmp_path, "Qwen3ForCausalLM", logit_scale=1.0, final_logit_softcapping=None)
    head = TeacherHead.from_hf(root, dtype="float64")
    assert head.logit_scale == 1.0 and torch.equal(head.weight, weight.double())


def test_the_table_names_each_action():
    assert {row.action for row in HEAD_TRANSFORMS} == {APPLIED, REFUSED, IN_STATES}
    assert {"lm_head_multiplier", "output_mult", "logit_scale", "logits_scaling", "final_logit_softcapping",
            "dim_model_base"} <= {row.key for row in HEAD_TRANSFORMS}
