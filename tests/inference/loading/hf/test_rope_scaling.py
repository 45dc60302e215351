"""RoPE of config.json as megatron-core builds it (JSON only): read from `rope_parameters` and from
the older `rope_scaling` alike; llama3 served with megatron-core's fixed values only, YaRN with the
attention factor megatron-core derives, dynamic / longrope refused by name."""
from __future__ import annotations

import pytest

from megatron_rl_patches.inference.loading.hf.rope_scaling import RopeScaling, RopeScalingError, read_rope

LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
QWEN_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def test_plain_rope_from_either_field():
    assert read_rope({}) == RopeScaling()
    assert read_rope({"rope_theta": 1e6, "partial_rotary_factor": 0.5}) == RopeScaling(theta=1e6, partial=0.5)
    assert read_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 5.0}}).theta == 5.0
    assert read_rope({}, partial_default=0.5).partial == 0.5  # glm4_moe's default where none is written
    assert read_rope({}).model_args() == {"position_embedding_type": "rope", "rotary_base": 10000.0,
                                          "rotary_percent": 1.0}
    assert read_rope({}).config_attributes() == {}


@pytest.mark.parametrize("field", ["rope_parameters", "rope_scaling"])
def test_llama3_served_with_megatron_cores_fixed_values(field):
    rope = read_rope({field: LLAMA31})
    assert (rope.kind, rope.factor, rope.theta) == ("llama3", 8.0, 500000.0)
    assert rope.model_args()["rope_scaling"] is True and rope.model_args()["rope_scaling_factor"] == 8.0


@pytest.mark.parametrize(("key", "value"), [("low_freq_factor", 2.0), ("high_freq_factor", 8.0),
                                            ("original_max_position_embeddings", 4096)])
def test_llama3_with_other_values_refused_by_name(key, value):
    with pytest.raises(RopeScalingError, match=rf"'llama3' with {key}={value!r}"):
        read_rope({"rope_scaling": {**LLAMA31, key: value}})


def test_yarn_from_rope_scaling_type():
    rope = read_rope({"rope_scaling": QWEN_YARN, "rope_theta": 1e6, "max_position_embeddings": 131072})
    assert (rope.kind, rope.factor, rope.original_max_positions, rope.theta) == ("yarn", 4.0, 32768, 1e6)
    assert rope.model_args()["position_embedding_type"] == "yarn"
    assert rope.config_attributes()["yarn_rotary_scaling_factor"] == 4.0
    assert rope.config_attributes()["yarn_mscale"] is None  # transformers uses mscale only with mscale_all_dim
    explicit = read_rope({"rope_scaling": {**QWEN_YARN, "attention_factor": 0.1 * __import__("math").log(4.0) + 1}})
    assert explicit.kind == "yarn"


@pytest.mark.parametrize(("extra", "named"), [({"attention_factor": 1.0}, "attention_factor=1.0"),
                                              ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5")])
def test_yarn_values_megatron_core_cannot_build_are_refused(extra, named):
    with pytest.raises(RopeScalingError, match=named):
        read_rope({"rope_parameters": {**QWEN_YARN, **extra}})


def test_linear():
    rope = read_rope({"rope_parameters": {"rope_type": "linear", "factor": 4.0}})
    assert rope.model_args()["seq_len_interpolation_factor"] == 4.0


@pytest.mark.parametrize("kind", ["dynamic", "longrope", "su", "proportional"])
def test_other_scalings_refused_by_name(kind):
    with pytest.raises(RopeScalingError, match=rf"RoPE scaling '{kind}' is not built exactly"):
        read_rope({"rope_scaling": {"type": kind, "factor": 2.0}})


@pytest.mark.parametrize("config", [{"rope_parameters": [1]}, {"rope_theta": -1},
                                    {"rope_parameters": {"rope_type": "linear"}}, {"partial_rotary_factor": 2}])
def test_bad_values_named(config):
    with pytest.raises(ValueError, match="rope|RoPE|partial_rotary_factor"):
        read_rope(config)
