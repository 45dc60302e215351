"""What a Hugging Face model family is to the converter: one `Family` record says how its
config.json becomes an HFArchitecture, which tensors a layer holds, which Hugging Face tensors make
each Megatron local-spec parameter and how they are fused, and how the Megatron model is built.
Every other module of `loading/hf/` reads a family through this record only."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture
from megatron_rl_patches.inference.loading.hf.families.common_kinds import REPLICATE, VOCAB
from megatron_rl_patches.inference.loading.hf.families.fields import seen_by
from megatron_rl_patches.inference.loading.hf.families.fuse_kind import FuseKind, Shape, fuse_kind, registered
from megatron_rl_patches.inference.loading.hf.families.kv_heads import kv_head_problems

EXPERT = "{e}"  # the expert index in a per-expert tensor's or parameter's name


@dataclass(frozen=True)
class Param:
    """One Megatron local-spec parameter: the Hugging Face tensors that make it (names under the same
    prefix as the parameter's; `{e}` in an expert's) and how they are fused (a `FuseKind`, or the name
    of a registered one: common_kinds.py, mla_kinds.py, hybrid_kinds.py, ...)."""

    hf: tuple[str, ...]
    kind: FuseKind

    def __post_init__(self) -> None:
        if not self.hf:
            raise ValueError(f"Param needs Hugging Face tensor names, got {self!r}")
        object.__setattr__(self, "kind", fuse_kind(self.kind))  # a name resolved once, here

    @property
    def expert(self) -> bool:
        """Sharded over the expert-parallel ranks, then the expert tensor-parallel ones."""
        return any(EXPERT in name for name in self.hf)


def __getattr__(name: str) -> tuple[str, ...]:
    """KINDS, SPLIT_KINDS, WHOLE_KINDS: the registered kinds' names (strings before kinds were objects)."""
    kinds = {"KINDS": registered(), "SPLIT_KINDS": [k for k in registered() if k.split],
             "WHOLE_KINDS": [k for k in registered() if not k.split]}.get(name)
    if kinds is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return tuple(kind.name for kind in kinds)


def model_tensors(arch: HFArchitecture) -> tuple[dict[str, Shape], dict[str, Shape]]:
    """The tensors outside the layers, those before them (the embedding) and those after them (the
    final norm, the output layer when untied): the checkpoint's order."""
    after: dict[str, Shape] = {"model.norm.weight": (arch.hidden_size,)}
    if not arch.tied:
        after["lm_head.weight"] = (arch.vocab_size, arch.hidden_size)
    return {"model.embed_tokens.weight": (arch.vocab_size, arch.hidden_size)}, after


def model_params(arch: HFArchitecture) -> dict[str, Param]:
    """The Megatron parameters outside the layers and their Hugging Face tensors."""
    return {
        "embedding.word_embeddings.weight": Param(("model.embed_tokens.weight",), VOCAB),
        "decoder.final_layernorm.weight": Param(("model.norm.weight",), REPLICATE),
        "output_layer.weight": Param(("model.embed_tokens.weight" if arch.tied else "lm_head.weight",), VOCAB),
    }


def gpt_local_spec(arch: HFArchitecture) -> Any:
    """megatron-core's GPT layer spec on local (non Transformer Engine) modules."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(num_experts=arch.num_experts or None, moe_grouped_gemm=False,
                                    qk_layernorm=arch.qk_norm, normalization="RMSNorm")


def gpt_model(arch: HFArchitecture) -> type:
    from megatron.core.models.gpt.gpt_model import GPTModel

    return GPTModel


def rope_model_args(arch: HFArchitecture) -> dict[str, Any]:
    """The model class's keywords read from config.json: the RoPE (scaled as rope_scaling.py maps
    it) and the length."""
    return {**arch.rope.model_args(), "max_sequence_length": arch.max_positions}


def no_overrides(arch: HFArchitecture) -> dict[str, Any]:
    return {}


def local_core_attention(arch: HFArchitecture) -> type | None:
    """None: the layer spec's own attention core (megatron-core's local DotProductAttention)."""
    return None


def transformer_config_class(arch: HFArchitecture) -> type:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig


def mtp_layer_prefixes(arch: HFArchitecture) -> tuple[str, ...]:
    """The tensors of multi-token prediction layers a real checkpoint stores after the decoder
    layers (`num_nextn_predict_layers`: GLM-4.5, DeepSeek-V3): not scored, so skipped when present."""
    return tuple(f"model.layers.{arch.num_layers + i}." for i in range(arch.mtp_layers))


def parallel_problems(arch: HFArchitecture, tp: int, ep: int) -> list[str]:
    """What the tensor / expert parallel sizes cannot split (key/value heads, neither divided nor
    repeated: kv_heads.py; experts)."""
    problems = kv_head_problems(arch, tp)  # divided over tp, or repeated up to it (kv_heads.py)
    if arch.is_moe and arch.num_experts % ep:
        problems.append(f"{arch.num_experts} experts are not a multiple of the expert-parallel size {ep}")
    if not arch.is_moe and ep > 1:
        problems.append(f"expert-parallel size {ep} with a dense model")
    return problems


@dataclass(frozen=True)
class Family:
    """One Hugging Face model family (see the module's docstring); `name` is its config.json
    `model_type`, `hf_class` the prefix of transformers' classes (`Qwen3Moe` -> Qwen3MoeConfig)."""

    name: str
    hf_class: str
    read: Callable[[dict[str, Any], str], HFArchitecture]  # config.json, source -> record or refusal; see architecture
    layer_tensors: Callable[[HFArchitecture, int], dict[str, Shape]]  # names under `layer_prefix`
    layer_params: Callable[[HFArchitecture, int], dict[str, Param]]  # local-spec name under decoder.layers.N.
    config_overrides: Callable[[HFArchitecture], dict[str, Any]] = no_overrides  # TransformerConfig fields
    config_class: Callable[[HFArchitecture], type] = transformer_config_class  # e.g. MLATransformerConfig
    layer_spec: Callable[[HFArchitecture], Any] = gpt_local_spec
    core_attention: Callable[[HFArchitecture], type | None] = local_core_attention  # where no core_attention= given
    model_class: Callable[[HFArchitecture], type] = gpt_model
    model_args: Callable[[HFArchitecture], dict[str, Any]] = rope_model_args
    parallel_problems: Callable[[HFArchitecture, int, int], list[str]] = parallel_problems  # (arch, tp, ep)
    outer_tensors: Callable[[HFArchitecture], tuple[dict[str, Shape], dict[str, Shape]]] = model_tensors
    outer_params: Callable[[HFArchitecture], dict[str, Param]] = model_params
    layer_prefix: str = "model.layers.{layer}."
    # (arch, config, vp_stage, pp_rank) -> this pipeline stage's block spec, where layers differ otherwise than
    # dense / MoE (pp_rank: a teacher's own stage, None: parallel_state's)
    stage_spec: Callable[[HFArchitecture, Any, int | None, int | None], Any] | None = None
    skipped: Callable[[HFArchitecture], tuple[str, ...]] = mtp_layer_prefixes  # tensor prefixes the loader skips
    mbridge: bool = False  # converter="mbridge" serves it on the local spec
    stacked_experts: bool = False  # checkpoints may stack the experts (fused_experts.py): read as per-expert views
    aliases: tuple[str, ...] = ()  # other model_types the family reads
    # config.json fields its reader sees beside fields.SHARED (transformers' forward of the family reads them)
    fields: frozenset[str] = frozenset()
    synonyms: tuple[tuple[str, ...], ...] = ()  # names of one field (fields.one_field): refused where they differ
    tiny_fields: Mapping[str, Any] = field(default_factory=dict)  # the test kit's tiny config.json (None: drop)

    @property
    def model_types(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def architecture(self, config: dict[str, Any], source: str) -> HFArchitecture:
        """`config`'s architecture as the family reads it (it sees its `fields` alone: a field
        transformers ignores for the family changes nothing), carrying the family (`arch.family`):
        the modules of a build take it from there instead of looking it up again."""
        return replace(self.read(seen_by(config, source, self.fields, self.synonyms), source), family=self)

