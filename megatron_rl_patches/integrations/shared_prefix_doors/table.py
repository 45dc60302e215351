"""The shared-prefix table: for each layout and model kind (a row, `Feature`) and each framework, what
its door does with MEGATRON_RL_PATCHES_SHARED_PREFIX=1 (`Cell`): shared, packed whole (one warning
naming why and what to change; refused under MEGATRON_RL_PATCHES_STRICT=1) or not a layout the
framework runs.

Two kinds of row. A door row (`present` set) is a fact of the run only the framework sees (verl's
`use_remove_padding`, NeMo-RL's sequence packing, a vision-language model, routing replay, ...): the
door reads its `Layout` and packs whole where the row's cell says so. A model row (`present` None:
TP, CP, PP, MLA, MoE, ...) is decided by the model's own check (`shared_prefix_reason`,
`config_reasons`: the same in every framework), which refuses by config field; its cell says what
the framework's users see, and `FIXES` which of the framework's settings changes a refused field."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megatron_rl_patches.integrations.shared_prefix_doors.frameworks import (
    FRAMEWORKS,
    MEGATRON,
    NEMO_RL,
    SLIME,
    VERL,
)

SHARED, WHOLE, NOT_RUN = "shared", "packed whole", "n.a."


@dataclass(frozen=True)
class Cell:
    """What a framework's door does at a row: `outcome` (SHARED, WHOLE, NOT_RUN), `why` (WHOLE: the
    reason, in the framework's words; SHARED: how, or under which setting; NOT_RUN: why it is not a
    layout of the framework) and `change` (WHOLE: what to change to share, in the framework's words)."""

    outcome: str
    why: str = ""
    change: str = ""


@dataclass(frozen=True)
class Layout:
    """The facts of a run a door reads beside the model: the parallel sizes and how the framework
    packs and calls the model (each framework sets those it has; the others keep their defaults)."""

    context_layout: str = "zigzag"  # how the framework cuts a micro-batch over context-parallel ranks
    dynamic_context: bool = False  # verl's dynamic_context_parallel
    packed: bool = True  # packed (thd); False: verl's use_remove_padding=False, NeMo-RL's sequence packing off
    vision: bool = False  # a vision-language model (its images merged into the embedding)
    routing_replay: bool = False  # MoE routes recorded by the rollout and replayed
    mtp_training: bool = False  # an MTP block that runs (verl's mtp.enable_train, NeMo-RL's mtp_num_layers)
    fixed_lengths: bool = False  # every micro-batch padded to one length for the pipeline (NeMo-RL at PP > 1)
    draft_capture: bool = False  # NeMo-RL: a draft model's hidden-state capture
    own_fused_head: bool = False  # NeMo-RL's own use_fused_linear_logprobs


@dataclass(frozen=True)
class Feature:
    """A row: `key`, `title` (the matrix's words), `cells` per framework key, `present` (a door row:
    whether the run has it; None: the model's check decides) and `fields`, the config fields the
    row stands for (a door row present drops the model's reasons naming them: said once, in the
    framework's words)."""

    key: str
    title: str
    cells: dict[str, Cell]
    present: Callable[[Layout], bool] | None = None
    fields: tuple[str, ...] = ()


def _all(outcome: str, why: str = "") -> dict[str, Cell]:
    return {key: Cell(outcome, why) for key in FRAMEWORKS}


VLM_WHY = "a vision-language model's prompt is merged with its images before the sharing plan could run"
REPLAY_WHY = ("the rollout's recorded expert choices are replayed per packed token, and this framework's passes do "
              "not yet hand them to the sharing plan")

FEATURES: tuple[Feature, ...] = (
    Feature("tp", "TP", _all(SHARED)),
    Feature("sp", "TP + SP", _all(SHARED)),
    Feature("cp-zigzag", "CP, zigzag", {
        SLIME: Cell(SHARED, "each pass plans the whole micro-batch slime keeps beside each rank's share"),
        VERL: Cell(SHARED, "the whole micro-batch rebuilt from the ranks' shares"),
        NEMO_RL: Cell(SHARED, "each pass plans the whole packed micro-batch NeMo-RL keeps beside each rank's share"),
        MEGATRON: Cell(SHARED, "the loop plans the whole micro-batch and passes each rank its share"),
    }),
    Feature("cp-contiguous", "CP, contiguous (allgather)", {
        SLIME: Cell(SHARED, "--allgather-cp"),
        VERL: Cell(NOT_RUN, "verl cuts contiguous only for DeepSeek-V4's hybrid attention"),
        NEMO_RL: Cell(NOT_RUN, "NeMo-RL cuts each sequence zigzag"),
        MEGATRON: Cell(SHARED, 'cp_layout="contiguous"'),
    }),
    Feature("dynamic-cp", "dynamic CP", {
        **_all(NOT_RUN, "verl's alone"),
        VERL: Cell(WHOLE, "verl's dynamic context parallelism cuts each micro-batch over ranks chosen per micro-batch",
                   "actor_rollout_ref.actor.megatron.dynamic_context_parallel=False"),
    }, present=lambda layout: layout.dynamic_context),
    Feature("pp", "PP", {
        SLIME: Cell(SHARED, "slime sets variable_seq_lengths"),
        VERL: Cell(SHARED, "each stage plans the micro-batch from verl's samples; verl sets variable_seq_lengths"),
        NEMO_RL: Cell(WHOLE, "NeMo-RL pads every packed micro-batch to one length for its pipeline schedule, which "
                             "sends fixed shapes (variable_seq_lengths unset)",
                      "policy.megatron_cfg.pipeline_model_parallel_size=1"),
        MEGATRON: Cell(SHARED, f"with {FRAMEWORKS[MEGATRON].change('variable_seq_lengths')}"),
    }, present=lambda layout: layout.fixed_lengths, fields=("pipeline_model_parallel_size",)),
    Feature("vpp", "VPP", {
        **{key: Cell(WHOLE, "interleaved (virtual) pipeline stages are not tested with a sharing plan",
                     FRAMEWORKS[key].change("virtual_pipeline_model_parallel_size")) for key in FRAMEWORKS},
    }),
    Feature("ep", "EP", _all(SHARED)),
    Feature("mtp", "MTP training (depth 1, 2)", {
        SLIME: Cell(SHARED, "--enable-mtp-training"),
        VERL: Cell(SHARED, "verl's own MTP loss rolls its labels on the sharing plan"),
        NEMO_RL: Cell(WHOLE, "NeMo-RL's MTP layers (mtp_num_layers) are not yet tested with a sharing plan",
                      "policy.megatron_cfg.mtp_num_layers=0, or switch the setting off"),
        MEGATRON: Cell(SHARED, "megatron-core's MTP loss on the sharing plan"),
    }, present=lambda layout: layout.mtp_training, fields=("mtp_num_layers",)),
    Feature("padded", "padded layout (no packing)", {
        SLIME: Cell(NOT_RUN, "slime packs every micro-batch (thd)"),
        VERL: Cell(WHOLE, "verl's padded layout (use_remove_padding=False) packs no sequences to share",
                   "actor_rollout_ref.model.use_remove_padding=True"),
        NEMO_RL: Cell(WHOLE, "sequence packing is off: a sharing plan is built from a packed micro-batch",
                      "policy.sequence_packing.enabled=true"),
        MEGATRON: Cell(NOT_RUN, "a sharing plan is built from a packed micro-batch's cu_seqlens"),
    }, present=lambda layout: not layout.packed),
    Feature("vlm", "vision-language model", {
        SLIME: Cell(WHOLE, f"{VLM_WHY} (slime's multimodal_train_inputs)", "none yet: switch the setting off"),
        VERL: Cell(WHOLE, f"{VLM_WHY} (hf_config.vision_config)", "none yet: switch the setting off"),
        NEMO_RL: Cell(WHOLE, f"{VLM_WHY} (NeMo-RL's multimodal inputs)", "none yet: switch the setting off"),
        MEGATRON: Cell(WHOLE, VLM_WHY, "pack its micro-batches whole"),
    }, present=lambda layout: layout.vision),
    Feature("routing-replay", "routing replay", {
        SLIME: Cell(SHARED, "slime's records handed to the sharing plan (--use-rollout-routing-replay, "
                            "--use-routing-replay), at CP = 1 and one pipeline stage"),
        VERL: Cell(WHOLE, f"{REPLAY_WHY} (router_replay.mode)", FRAMEWORKS[VERL].change("moe_enable_routing_replay")),
        NEMO_RL: Cell(WHOLE, f"{REPLAY_WHY} (use_router_replay)",
                      FRAMEWORKS[NEMO_RL].change("moe_enable_routing_replay")),
        MEGATRON: Cell(SHARED, "plan_shared_prefix(..., routed_experts=) with the records RouterReplay.set_replay_data "
                               "replays (moe_enable_routing_replay; at CP = 1, each micro-batch planned on its own)"),
    }, present=lambda layout: layout.routing_replay, fields=("moe_enable_routing_replay",)),
    Feature("draft", "a draft model's hidden-state capture", {
        **_all(NOT_RUN, "NeMo-RL's alone"),
        NEMO_RL: Cell(WHOLE, "a draft model's hidden-state capture reads every packed row",
                      "policy.draft.enabled=false"),
    }, present=lambda layout: layout.draft_capture),
    Feature("nemo-fused-head", "NeMo-RL's own fused log-probs", {
        **_all(NOT_RUN, "NeMo-RL's alone"),
        NEMO_RL: Cell(WHOLE, "use_fused_linear_logprobs runs NeMo-RL's own GPTModel.forward",
                      "policy.megatron_cfg.use_fused_linear_logprobs=false (the package's fused head, patch "
                      "nemo_rl_fused_logprobs, shares)"),
    }, present=lambda layout: layout.own_fused_head),
    Feature("mla", "multi-latent attention", {
        key: Cell(SHARED, f"without fused RoPE: {FRAMEWORKS[key].change('apply_rope_fusion')}") for key in FRAMEWORKS
    }),
    Feature("gdn", "gated delta nets", {
        SLIME: Cell(SHARED, "slime's own layers (Qwen3.5, Qwen3-Next), CP too"),
        VERL: Cell(SHARED, "megatron-core 0.16-0.18's GatedDeltaNet at CP = 1 (verl 0.9 pins 0.18); packed whole on "
                           "0.19's rewritten layer and at CP > 1"),
        NEMO_RL: Cell(WHOLE, "NeMo-RL builds megatron-core main's rewritten gated delta net, which reads the packed "
                             "sequences itself", "none yet: switch the setting off"),
        MEGATRON: Cell(SHARED, "megatron-core 0.16-0.18's GatedDeltaNet at CP = 1"),
    }),
    Feature("moe", "MoE", {
        key: Cell(SHARED, "without token dropping; its statistics count a shared token once per sample")
        for key in FRAMEWORKS
    }),
)

# a refused config field -> the fields a user changes (the field itself where it is not listed)
FIXES: dict[str, tuple[str, ...]] = {"multi_latent_attention": ("apply_rope_fusion",),
                                     "pipeline_model_parallel_size": ("variable_seq_lengths",)}


def feature(key: str) -> Feature:
    return next(f for f in FEATURES if f.key == key)


def door_rows(framework: str, layout: Layout) -> list[tuple[Feature, Cell]]:
    """The door rows this run has where `framework` packs whole."""
    found = []
    for row in FEATURES:
        if row.present is None or not row.present(layout):
            continue
        cell = row.cells[framework]
        if cell.outcome == WHOLE:
            found.append((row, cell))
    return found
