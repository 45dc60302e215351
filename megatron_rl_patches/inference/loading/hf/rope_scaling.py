"""RoPE of a Hugging Face config.json as megatron-core builds it: read from `rope_parameters`
(transformers 5) or `rope_scaling` (the older field; `type` for `rope_type`) as transformers reads
them, and mapped exactly or refused by name. Served: plain RoPE, `linear` (megatron-core's
`seq_len_interpolation_factor`), `llama3` (`RotaryEmbedding(rope_scaling=True)`, whose frequency
factors 1 / 4 and original length 8192 are fixed) and `yarn` (`position_embedding_type="yarn"` with
the `yarn_*` attributes it reads from the config). JSON only: the memory planner imports it."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SERVED = ("default", "linear", "llama3", "yarn")
# megatron-core's llama3 scaling hard-codes these (RotaryEmbedding._apply_scaling)
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class RopeScalingError(ValueError):
    """A RoPE type or a value of it megatron-core cannot build exactly (the architecture reader
    raises it as UnsupportedCheckpointError)."""


@dataclass(frozen=True)
class RopeScaling:
    """A checkpoint's RoPE: its type (one of SERVED), base, rotated fraction of each head and the
    scaling's values (`factor` 1.0 and the rest unused for plain RoPE)."""

    kind: str = "default"
    theta: float = 10000.0
    partial: float = 1.0  # partial_rotary_factor: megatron-core's rotary_percent
    factor: float = 1.0
    original_max_positions: int = 0  # llama3 / yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0
    mscale: float | None = None  # yarn: both or neither (transformers uses them only together)
    mscale_all_dim: float | None = None
    truncate: bool = True  # yarn: the correction range rounded to whole dimensions

    def model_args(self) -> dict[str, Any]:
        """GPTModel keywords of this RoPE."""
        args: dict[str, Any] = {"position_embedding_type": "yarn" if self.kind == "yarn" else "rope",
                                "rotary_base": self.theta, "rotary_percent": self.partial}
        if self.kind == "linear":
            args["seq_len_interpolation_factor"] = self.factor
        if self.kind == "llama3":
            args.update(rope_scaling=True, rope_scaling_factor=self.factor)
        return args

    def config_attributes(self) -> dict[str, Any]:
        """The attributes megatron-core's YaRN embedding and attention read from the
        TransformerConfig (set after it is made: the plain config declares none of them, and
        attention applies YaRN's attention factor wherever `yarn_rotary_scaling_factor` exists)."""
        if self.kind != "yarn":
            return {}
        return {"yarn_rotary_scaling_factor": self.factor,
                "yarn_original_max_position_embeddings": self.original_max_positions,
                "yarn_beta_fast": self.beta_fast, "yarn_beta_slow": self.beta_slow,
                "yarn_mscale": self.mscale, "yarn_mscale_all_dim": self.mscale_all_dim,
                "yarn_correction_range_round_to_int": self.truncate}


def _number(rope: dict[str, Any], name: str, default: Any, source: str) -> Any:
    value = rope.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{source}: config.json's {name} must be a positive number, got {value!r}")
    return value


def _yarn_attention_factor(factor: float, mscale: float | None, mscale_all_dim: float | None) -> float:
    """transformers' default YaRN attention factor (megatron-core computes the same from its fields)."""
    def get(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    return get(factor, mscale) / get(factor, mscale_all_dim) if mscale and mscale_all_dim else get(factor)


def _refuse(source: str, what: str) -> RopeScalingError:
    return RopeScalingError(
        f"{source}: RoPE {what} is not built exactly by megatron-core's rotary embeddings, so the converter "
        f"refuses it (served: {', '.join(SERVED)} with the values listed in docs/inference-only.md); build this "
        "teacher with build_inference_model and your own model provider"
    )


def read_rope(config: dict[str, Any], source: str = "config.json", partial_default: float | None = 1.0
              ) -> RopeScaling:
    """The RoPE of a config.json dict; RopeScalingError naming a type or a value megatron-core cannot
    build. `partial_default`: the family's partial_rotary_factor where the config writes none, or None
    for a family whose default RoPE ignores the field (transformers' llama, qwen2, qwen3, mixtral,
    deepseek_v3...: their rotary embedding rotates whole heads whatever it says)."""
    tables = [config.get(name) or {} for name in ("rope_scaling", "rope_parameters")]
    if not all(isinstance(table, dict) for table in tables):
        raise ValueError(f"{source}: rope_parameters / rope_scaling must be an object")
    # as transformers 5: a scaled rope_scaling beside rope_parameters (Qwen's YaRN recipe) wins
    rope = next((t for t in tables if (t.get("rope_type") or t.get("type") or "default") != "default"),
                tables[1] or tables[0])
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in SERVED:
        raise _refuse(source, f"scaling {kind!r}")
    theta = float(_number(rope, "rope_theta", None, source) or _number(tables[1], "rope_theta", None, source)
                  or _number(tables[0], "rope_theta", None, source) or _number(config, "rope_theta", 10000.0, source))
    if partial_default is None and kind == "default":
        return RopeScaling(theta=theta)  # the field is not read: any value, even a malformed one, changes nothing
    partial = float(_number(rope, "partial_rotary_factor", None, source)
                    or _number(config, "partial_rotary_factor", partial_default or 1.0, source))
    if partial > 1:
        raise ValueError(f"{source}: partial_rotary_factor must be in (0, 1], got {partial}")
    if partial_default is None and partial < 1:  # transformers' scaled RoPE reads it, its attention does not
        raise _refuse(source, f"scaling {kind!r} with partial_rotary_factor={partial} (transformers then makes "
                      "frequencies for part of each head while this family's attention rotates whole heads: its own "
                      "forward fails or mis-rotates; drop the field or set it to 1.0)")
    if kind == "default":
        return RopeScaling(theta=theta, partial=partial)
    # as transformers: a top-level original_max_position_embeddings first (Phi-3 writes it there)
    original = int(_number(config, "original_max_position_embeddings", None, source)
                   or _number(rope, "original_max_position_embeddings", None, source)
                   or _number(config, "max_position_embeddings", 0, source))
    factor = _number(rope, "factor", None, source)
    if factor is None and kind == "yarn" and original:
        factor = _number(config, "max_position_embeddings", 0, source) / original  # as transformers infers it
    if factor is None:
        raise ValueError(f"{source}: RoPE scaling {kind!r} needs a factor")
    if kind == "linear":
        return RopeScaling("linear", theta, partial, float(factor))
    if kind == "llama3":
        given = {"low_freq_factor": rope.get("low_freq_factor"), "high_freq_factor": rope.get("high_freq_factor"),
                 "original_max_position_embeddings": original}
        other = [f"{name}={given[name]!r}" for name, fixed in LLAMA3_FIXED.items() if given[name] != fixed]
        if other:
            raise _refuse(source, f"scaling 'llama3' with {', '.join(other)} (megatron-core fixes "
                          + ", ".join(f"{k}={v}" for k, v in LLAMA3_FIXED.items()) + ")")
        return RopeScaling("llama3", theta, partial, float(factor), original)
    if partial < 1:
        raise _refuse(source, f"scaling 'yarn' with partial_rotary_factor={partial} (megatron-core's YaRN "
                      "embedding rotates whole heads)")
    mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
    if not (mscale and mscale_all):  # transformers uses neither unless both are set
        mscale = mscale_all = None
    attention = rope.get("attention_factor")
    if attention is not None and not math.isclose(attention, _yarn_attention_factor(factor, mscale, mscale_all),
                                                  rel_tol=1e-9):
        raise _refuse(source, f"scaling 'yarn' with attention_factor={attention!r} (megatron-core derives it "
                      "from factor / mscale)")
    return RopeScaling("yarn", theta, partial, float(factor), original,
                       float(rope.get("beta_fast") or 32.0), float(rope.get("beta_slow") or 1.0),
                       mscale, mscale_all, bool(rope.get("truncate", True)))
