"""A framework door's verdict from a model's config and a layout alone, before any GPU is booked
(`megatron-rl-patches shared-prefix check`): no model is built and no weight read. The model's config
fields, as the framework builds its TransformerConfig (its own defaults: slime's Megatron arguments
fuse RoPE, verl and NeMo-RL too; slime and verl set `variable_seq_lengths`), go through the model's
own check (`config_reasons`, the one every door runs); the kinds only a layer's class shows (a gated
delta net, DeepSeek sparse attention) are read per framework and megatron-core version; the door rows
(a vision-language model, routing replay, NeMo-RL's fixed pipeline lengths) come from the table."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from megatron_rl_patches.integrations.shared_prefix_doors.decision import Reason, changes, pass_verdict
from megatron_rl_patches.integrations.shared_prefix_doors.frameworks import FRAMEWORKS, MEGATRON, NEMO_RL, SLIME, VERL
from megatron_rl_patches.integrations.shared_prefix_doors.table import FEATURES, SHARED, Layout

PACKED_WHOLE, REFUSED = "packed whole", "refused"
# the megatron-core each framework runs (slime 624b824a pins a Megatron-LM dev commit of 0.16, verl 0.9 pins
# 0.18, NeMo-RL follows Megatron-LM main); a hand-written loop: the one installed here, else 0.16
MEGATRON_CORE = {SLIME: "0.16", VERL: "0.18", NEMO_RL: "0.20", MEGATRON: None}
# the config each framework builds beside the model's own fields (where it differs from TransformerConfig's)
DEFAULTS: dict[str, dict[str, Any]] = {
    SLIME: {"apply_rope_fusion": True, "variable_seq_lengths": True},  # Megatron's --no-rope-fusion off; slime's args
    VERL: {"apply_rope_fusion": True, "variable_seq_lengths": True},  # verl's config converter, its engine
    NEMO_RL: {"apply_rope_fusion": True},  # NeMo-RL's megatron_cfg default
    MEGATRON: {},
}


@dataclass(frozen=True)
class ModelFacts:
    """What a config says of a model: a name, its TransformerConfig `fields`, and the kinds only a layer's
    class shows (`gated_delta_net`: Qwen3.5's, Qwen3-Next's linear attention; `sparse_attention`: DSA);
    `vision`: a vision-language model; `kinds`: the words the report names the model's kinds with."""

    name: str
    fields: dict[str, Any] = field(default_factory=dict)
    gated_delta_net: bool = False
    sparse_attention: bool = False
    vision: bool = False
    kinds: tuple[str, ...] = ()


@dataclass(frozen=True)
class Parallel:
    """The layout a job would run: tensor, context, pipeline, virtual pipeline and expert parallel sizes,
    sequence parallelism (None: the framework's default, on with TP > 1 for verl), the context-parallel
    cut and whether the rollout's routes are replayed."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    vpp: int | None = None
    sp: bool | None = None
    cp_layout: str = "zigzag"
    routing_replay: bool = False

    def fields(self, framework_key: str) -> dict[str, Any]:
        sp = self.sp if self.sp is not None else (framework_key == VERL and self.tp > 1)
        return {"tensor_model_parallel_size": self.tp, "context_parallel_size": self.cp,
                "pipeline_model_parallel_size": self.pp, "virtual_pipeline_model_parallel_size": self.vpp,
                "expert_model_parallel_size": self.ep, "sequence_parallel": bool(sp and self.tp > 1)}


@dataclass(frozen=True)
class Verdict:
    """A pass's answer: `outcome` (shared, packed whole, refused) and its reasons (the framework's words)."""

    outcome: str
    reasons: tuple[Reason, ...] = ()

    def said(self) -> str:
        if self.outcome == SHARED:
            return SHARED
        return f"{self.outcome}, because " + "; ".join(reason.said() for reason in self.reasons)


def version_tuple(version: str | None) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(found[1]), int(found[2])) if found else (0, 16)


def class_reasons(framework_key: str, model: ModelFacts, parallel: Parallel, version: str | None) -> list[Reason]:
    """What a layer's class decides, which no config field says: whose gated delta net or DSA the framework
    builds, on which megatron-core."""
    reasons = []
    core = version_tuple(version)
    if model.gated_delta_net and framework_key != SLIME and core >= (0, 19):
        reasons.append(Reason(f"megatron-core {version}'s rewritten gated delta net (ssm/gated_delta_net/) reads the "
                              "packed sequences itself", "megatron-core 0.16 to 0.18, or switch the setting off"))
    if model.sparse_attention and framework_key == SLIME:
        reasons.append(Reason("slime's GLM-5 DSA layer (DSAMultiLatentAttention: tilelang CUDA kernels taking one "
                              "contiguous key range per query, where a shared row sees its prefix and itself)",
                              "none yet: switch the setting off"))
    elif model.sparse_attention and core < (0, 19):
        reasons.append(Reason(f"DSA on megatron-core {version}: its DSAttention refuses packed input",
                              "megatron-core 0.19 or later"))
    if core < (0, 16) and (model.fields.get("multi_latent_attention") or parallel.cp > 1):
        reasons.append(Reason(f"multi-latent attention or context parallelism on megatron-core {version}: tested exact "
                              "on 0.16 and later", "megatron-core 0.16 or later"))
    return reasons


def config_fields(framework_key: str, model: ModelFacts, parallel: Parallel) -> dict[str, Any]:
    """The TransformerConfig fields the framework would build for `model` at `parallel` (a slime gated delta
    net is slime's own layer: no megatron-core variant in the config)."""
    fields = {**DEFAULTS[framework_key], **parallel.fields(framework_key), **model.fields}
    if model.gated_delta_net and framework_key != SLIME:
        fields.setdefault("experimental_attention_variant", "gated_delta_net")
    if model.sparse_attention and framework_key != SLIME:
        fields.setdefault("experimental_attention_variant", "dsa")
    if parallel.routing_replay and model.fields.get("num_moe_experts"):
        fields["moe_enable_routing_replay"] = True
    return fields


def offline_verdicts(framework_key: str, model: ModelFacts, parallel: Parallel, *, strict: bool = False,
                     version: str | None = None) -> dict[str, Verdict]:
    """{pass: Verdict} for each pass of `framework_key`'s door (the first, the training step, with
    gradients; the others forward-only) on `model` at `parallel`: shared, packed whole (one warning), or
    refused (under `strict`, and always for a hand-written loop, whose `check_shared_prefix` raises)."""
    from megatron_rl_patches.shared_prefix.refusals import config_reasons  # lazy: import cost (torch)

    door = FRAMEWORKS[framework_key]
    version = version or MEGATRON_CORE[framework_key]
    layout = Layout(context_layout=parallel.cp_layout, vision=model.vision, routing_replay=parallel.routing_replay,
                    fixed_lengths=framework_key == NEMO_RL and parallel.pp > 1,
                    mtp_training=bool(model.fields.get("mtp_num_layers")))
    config = type("ModelConfig", (), {})()
    vars(config).update(config_fields(framework_key, model, parallel))
    refused = REFUSED if strict or framework_key == MEGATRON else PACKED_WHOLE
    verdicts = {}
    for index, name in enumerate(door.passes):
        said = config_reasons(config, training=index == 0)
        reasons = pass_verdict(framework_key, layout, extra=tuple(class_reasons(framework_key, model, parallel,
                                                                                version)))
        # a door row that packs whole says its fields once, in the framework's words; a row the door shares leaves
        # the model's own check to refuse what it still cannot run (routing replay beside context parallelism)
        covered = {f for row in FEATURES if row.present is not None and row.present(layout)
                   and row.cells[framework_key].outcome != SHARED for f in row.fields}
        reasons += [Reason(reason, changes(framework_key, reason)) for reason in said
                    if not covered & set(re.findall(r"\((\w+)=", reason))]
        verdicts[name] = Verdict(refused if reasons else SHARED, tuple(dict.fromkeys(reasons)))
    return verdicts

