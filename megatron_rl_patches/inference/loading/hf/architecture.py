"""A Hugging Face checkpoint's architecture from its config.json alone (JSON, no torch, no
transformers): the record the converter builds from, the fields it reads and checks, and the
features it refuses. Which family reads which config.json is the registry's (`families/`); the
memory planner (`megatron-rl-patches memory --hf`) and the builder share both. config.json itself is
read by `checkpoint_config` (one reader for every entry point)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_rl_patches.inference.loading.hf.rope_scaling import RopeScaling, RopeScalingError, read_rope


class UnsupportedCheckpointError(ValueError):
    """A config.json the converter cannot serve (a family or a feature it does not map)."""


@dataclass(frozen=True)
class HFArchitecture:
    """The fields of config.json the Megatron build needs (a decoder-only, RMSNorm, SwiGLU,
    RoPE transformer): those every family has, and a family's own in its typed piece (`mla`,
    `linear`, `sigmoid_router`: None where the family has none)."""

    source: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    norm_eps: float
    rope_theta: float
    max_positions: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int = 0
    experts_per_token: int = 0
    expert_ffn_hidden_size: int = 0
    norm_topk_prob: bool = False
    rope: RopeScaling = RopeScaling()  # its type, base, rotated fraction and scaling
    # mixtures of experts beyond a top-k softmax router (glm4_moe, qwen2_moe)
    sigmoid_router: Any = None  # GLM-4.5's / DeepSeek-V3's (families/sigmoid_router.py's SigmoidRouter), None: softmax
    shared_expert_ffn: int = 0  # the width of the shared expert every token runs (0: none)
    shared_expert_gate: bool = False  # the shared expert's output scaled by sigmoid(gate . x)
    dense_layers: int = 0  # the first layers of a mixture of experts, with a dense MLP
    mtp_layers: int = 0  # multi-token prediction layers a real checkpoint stores (not scored: skipped)
    mla: Any = None  # multi-latent attention's shape (families/mla.py's MLAShape), None for q/k/v attention
    layer_types: tuple[str, ...] = ()  # per layer, where layers differ ("linear_attention" / "full_attention")
    vision_params: int = 0  # a vision-language wrapper's vision tower (not built: counted apart by `memory --hf`)
    linear: Any = None  # the gated delta net's shape (families/qwen3_5.py's LinearShape), None without one
    rope_scaling: str = ""  # '' or why its RoPE scaling is not served: built only when '' (refuse_rope_scaling)
    # the family that read it (families/family.py's Family), set where config.json is read
    # (families.architecture): looked up once, the modules of the build take it from here
    family: Any = field(default=None, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def read_field(config: dict[str, Any], source: str, *names: str, default: Any = None) -> Any:
    """The first of `names` config.json writes (not null), else `default`, else a ValueError naming them."""
    for name in names:
        if config.get(name) is not None:
            return config[name]
    if default is not None:
        return default
    raise ValueError(f"{source}: config.json has no {' / '.join(names)}; is it a complete Hugging Face config?")


def read_count(config: dict[str, Any], source: str, *names: str, default: Any = None) -> int:
    """`read_field` checked to be a positive integer (a size, a count)."""
    value = read_field(config, source, *names, default=default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{source}: config.json's {names[0]} must be a positive integer, got {value!r}")
    return value


def read_natural(config: dict[str, Any], source: str, name: str) -> int:
    """A count config.json may leave out or set to 0 or null (shared experts, dense first layers, MTP layers)."""
    value = config.get(name)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{source}: config.json's {name} must be an integer >= 0, got {value!r}")
    return value


def read_number(config: dict[str, Any], source: str, name: str, value: Any) -> float:
    """A real number config.json gives for `name` (a ValueError naming the field and the file otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{source}: config.json's {name} must be a positive number, got {value!r}")
    return float(value)


def _rope_table(config: dict[str, Any], source: str, name: str) -> dict[str, Any]:
    table = config.get(name)
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise ValueError(f"{source}: config.json's {name} must be an object (rope_type, rope_theta, ...), "
                         f"got {type(table).__name__} {table!r}")
    return table


def _rope(config: dict[str, Any], source: str, partial_default: float | None) -> tuple[RopeScaling, str]:
    """The RoPE megatron-core builds for config.json (rope_scaling.py) and '', or plain RoPE and the
    reason a scaling is not served (kept in the record: the memory planner sizes such checkpoints,
    scaling changes no weight; the builder refuses it)."""
    for name in ("rope_parameters", "rope_scaling"):
        _rope_table(config, source, name)  # a table that is no object: named as such
    try:
        return read_rope(config, source, partial_default), ""
    except RopeScalingError as exc:
        return RopeScaling(theta=_rope_theta(config, source)), str(exc)


def _rope_theta(config: dict[str, Any], source: str) -> float:
    """transformers 5.x keeps RoPE under rope_parameters; 4.x had rope_theta / rope_scaling."""
    params, scaling = _rope_table(config, source, "rope_parameters"), _rope_table(config, source, "rope_scaling")
    theta = params.get("rope_theta") or scaling.get("rope_theta") or config.get("rope_theta") or 10000.0
    return read_number(config, source, "rope_theta", theta)


def refuse_rope_scaling(arch: HFArchitecture) -> None:
    """UnsupportedCheckpointError naming a RoPE scaling the converter does not serve (the model would
    build and be wrong: 1.5-3 nats from transformers' own forward)."""
    if arch.rope_scaling:
        raise UnsupportedCheckpointError(arch.rope_scaling)


def unmapped_features(config: dict[str, Any]) -> list[str]:
    """The features of a dense-attention SwiGLU config.json the converter does not map (every family's)."""
    act = config.get("hidden_act", "silu")
    problems = []
    if act != "silu":
        problems.append(f"hidden_act={act!r} (SwiGLU with silu only)")
    if config.get("use_sliding_window"):
        problems.append("use_sliding_window=true")
    if config.get("mlp_bias"):
        problems.append("mlp_bias=true")
    types = config.get("layer_types")
    kinds = set(types) if isinstance(types, list) and all(isinstance(t, str) for t in types) else set()
    if "sliding_attention" in kinds and kinds <= {"full_attention", "sliding_attention"}:  # qwen2 / qwen3
        problems.append("layer_types with 'sliding_attention' (full attention only)")
    return problems


def refuse_unmapped(source: str, problems: list[str]) -> None:
    """UnsupportedCheckpointError naming every feature in `problems` (none: nothing happens)."""
    if problems:
        raise UnsupportedCheckpointError(
            f"{source}: the converter does not map {', '.join(problems)}; build this teacher with "
            "build_inference_model and your own model provider"
        )


def decoder_architecture(config: dict[str, Any], source: str, *, qkv_bias: bool, qk_norm: bool, moe: bool,
                         refused: list[str] | tuple[str, ...] = (), partial_rotary: float | None = None
                         ) -> HFArchitecture:
    """The HFArchitecture of a decoder-only RMSNorm / SwiGLU / RoPE config.json: `qkv_bias` is the
    family's default where `attention_bias` is not written, `qk_norm` and `moe` are the family's,
    `refused` the family's own unmapped features (refused with the common ones before reading),
    `partial_rotary` the family's partial_rotary_factor where config.json writes none, None where its
    default RoPE ignores the field (as transformers' llama / qwen2 / qwen3 / mixtral do)."""
    refuse_unmapped(source, [*unmapped_features(config), *refused])
    rope, rope_refused = _rope(config, source, partial_rotary)
    hidden = read_count(config, source, "hidden_size")
    heads = read_count(config, source, "num_attention_heads")
    kv_heads = read_count(config, source, "num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise ValueError(f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    tied = config.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):  # bool("false") is True: the output layer would be dropped
        raise ValueError(f"{source}: config.json's tie_word_embeddings must be true or false, got {tied!r}")
    experts = read_count(config, source, "num_experts", "num_local_experts", "n_routed_experts") if moe else 0
    per_token = read_count(config, source, "num_experts_per_tok") if moe else 0
    if per_token > experts:
        raise ValueError(f"{source}: config.json's num_experts_per_tok={per_token} exceeds num_experts={experts}")
    return HFArchitecture(
        source=source,
        model_type=str(config.get("model_type")),
        vocab_size=read_count(config, source, "vocab_size"),
        hidden_size=hidden,
        num_layers=read_count(config, source, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=read_count(config, source, "head_dim", default=hidden // heads),
        ffn_hidden_size=read_count(config, source, "intermediate_size"),
        norm_eps=read_number(config, source, "rms_norm_eps", read_field(config, source, "rms_norm_eps", default=1e-6)),
        rope_theta=rope.theta,
        max_positions=read_count(config, source, "max_position_embeddings", default=4096),
        tied=tied,
        qkv_bias=bool(config.get("attention_bias", qkv_bias)),
        qk_norm=qk_norm,
        num_experts=experts,
        experts_per_token=per_token,
        expert_ffn_hidden_size=read_count(config, source, "moe_intermediate_size") if moe else 0,
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        rope_scaling=rope_refused,
        rope=rope,
    )
