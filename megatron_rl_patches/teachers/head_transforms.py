"""What a served engine does to the logits after the final hidden states it pools
(`HEAD_TRANSFORMS`, `head_logit_scale`): vLLM 0.32's pooling runner sends the states its model's
forward returns, and its `compute_logits` then projects them through the output layer and, per
model family, scales or soft-caps the logits (`LogitsProcessor(scale=..., soft_cap=...)`). A
`TeacherHead` must form the same logits from the same states: a scale s is applied (the head's
weight read times s: h·(sW)ᵀ = s·h·Wᵀ, for every route that projects through `head.weight`); a
soft cap or a bias on the output layer is refused by name; a multiplier applied inside the forward
(MiniCPM's) is in the pooled states already. A transform field this table does not know for the
checkpoint's architecture is refused by name (what the engine does with it is not known here).
Standard library only."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_rl_patches.teachers.finite import finite, shown

APPLIED, REFUSED, IN_STATES = "applied", "refused", "in the pooled states"


@dataclass(frozen=True)
class HeadTransform:
    """One row: config.json's `key` read by vLLM 0.32 for the `architectures` (config.json's
    `architectures[0]`, vLLM's model class; () for every architecture), what the engine `does`
    with it, the package's `action`, and the value the engine sees where config.json omits the key
    (transformers' config default for those architectures; None: no transform)."""

    key: str
    architectures: tuple[str, ...]
    family: str
    does: str
    action: str
    default: float | None = None


LLAMA_LIKE = ("LlamaForCausalLM", "LLaMAForCausalLM", "InternLM3ForCausalLM", "IQuestCoderForCausalLM",
              "TeleChat3ForCausalLM", "ApertusForCausalLM", "ExaoneForCausalLM", "Exaone4ForCausalLM",
              "ExaoneMoeForCausalLM", "ExaoneMoEForCausalLM", "NemotronForCausalLM", "DeciLMForCausalLM",
              "SolarForCausalLM", "AriaForConditionalGeneration")
COHERE = ("CohereForCausalLM", "Cohere2ForCausalLM", "Cohere2MoeForCausalLM")
GRANITE_DENSE = ("GraniteForCausalLM", "GraniteSWAForCausalLM")
GRANITE = (*GRANITE_DENSE, "GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM", "GraniteMoeSWAForCausalLM",
           "GraniteMoeHybridForCausalLM")
HYPERCLOVAX = ("HyperCLOVAXForCausalLM",)

HEAD_TRANSFORMS: tuple[HeadTransform, ...] = (
    HeadTransform("logit_scale", LLAMA_LIKE + GRANITE_DENSE + HYPERCLOVAX,
                  "Llama, Apertus, EXAONE, Nemotron, DeciLM, Solar, Aria, Granite, HyperCLOVAX",
                  "logits × logit_scale", APPLIED),
    HeadTransform("logit_scale", COHERE, "Cohere (Command R), Cohere 2, Cohere 2 MoE",
                  "logits × logit_scale (0.0625 where config.json omits it)", APPLIED, 0.0625),
    HeadTransform("logits_scaling", GRANITE, "Granite, Granite MoE (shared, hybrid)", "logits ÷ logits_scaling",
                  APPLIED),
    HeadTransform("logits_scaling", HYPERCLOVAX, "HyperCLOVAX", "logits × logits_scaling (muP)", APPLIED),
    HeadTransform("lm_head_multiplier", ("FalconH1ForCausalLM",), "Falcon-H1", "logits × lm_head_multiplier",
                  APPLIED),
    HeadTransform("output_mult", ("TeleFLMForCausalLM",), "TeleFLM",
                  "logits × output_mult ÷ mup_scale_factor when use_mup", APPLIED),
    HeadTransform("final_logit_softcapping", (), "Gemma 2, Gemma 3, Gemma 3n, Gemma 4, Rnj-1, MuseGlimmer",
                  "logits → cap·tanh(logits / cap) (Gemma 2 and 3n: cap 30 where config.json omits it)", REFUSED),
    HeadTransform("output_multiplier", ("MuseGlimmerForCausalLM", "MuseGlimmerForConditionalGeneration"),
                  "MuseGlimmer", "logits × output_multiplier, then soft-capped", REFUSED),
    HeadTransform("lm_head.bias", (), "GPT-J, PhiMoE", "logits + the output layer's bias (a tensor, not a field)",
                  REFUSED),
    HeadTransform("dim_model_base", ("MiniCPMForCausalLM", "MiniCPM3ForCausalLM"), "MiniCPM, MiniCPM3",
                  "states ÷ (hidden_size / dim_model_base) inside the forward, before the states are pooled",
                  IN_STATES),
)
# where config.json omits the soft cap, transformers' default for these architectures sets one
SOFTCAP_DEFAULTS = {"Gemma2ForCausalLM": 30.0, "Gemma3nForCausalLM": 30.0, "Gemma3nForConditionalGeneration": 30.0,
                    "MuseGlimmerForCausalLM": 20.0, "MuseGlimmerForConditionalGeneration": 20.0}
# the fields some engine reads as a logits multiplier: set on an architecture no row names, refused
# (final_logit_softcapping, a soft cap, is refused on every architecture)
SCALE_KEYS = ("logit_scale", "logits_scaling", "lm_head_multiplier", "output_mult", "output_multiplier")
ENGINE = "vLLM 0.32"


def architecture_of(fields: dict[str, Any], text: dict[str, Any]) -> str:
    """config.json's first architecture (the model class an engine builds), '' where none."""
    for config in (fields, text):
        names = config.get("architectures")
        if isinstance(names, list) and names and isinstance(names[0], str):
            return names[0]
    return ""


def head_logit_scale(fields: dict[str, Any], text: dict[str, Any], tensors: Any, source: str) -> float:
    """The factor the engine multiplies the logits by after the output layer for this checkpoint
    (`fields`: config.json as written, `text`: its language model's; `tensors`: the tensor names);
    ValueError naming the field for a transform the head cannot form (see the module's words)."""
    architecture = architecture_of(fields, text)

    def value(key: str, default: float | None = None) -> Any:
        for config in (text, fields):
            if config.get(key) is not None:
                return config[key]
        return default

    def refuse(key: str, found: Any, why: str) -> ValueError:
        return ValueError(f"TeacherHead.from_hf: {source!r}'s config.json ({architecture or 'no architectures'}) "
                          f"sets {key}={found!r}: {why}; the served hidden states do not carry it, and the head "
                          f"forms h·Wᵀ/τ times a scale only, so this teacher's distribution cannot be formed from "
                          f"its head (use an in-process teacher, or a served teacher's top-k without head=; "
                          f"docs/distillation.md lists the transforms applied)")

    if "lm_head.bias" in tensors:
        raise refuse("lm_head.bias", "a tensor", "the output layer has a bias, which the engine adds to the logits")
    cap = value("final_logit_softcapping", SOFTCAP_DEFAULTS.get(architecture))
    if cap is not None:
        raise refuse("final_logit_softcapping", cap, f"{ENGINE} soft-caps the logits (cap·tanh(logits / cap))")
    scale = 1.0
    for key in SCALE_KEYS:
        rows = [row for row in HEAD_TRANSFORMS if row.key == key and architecture in row.architectures]
        found = value(key, rows[0].default if rows else None)
        if found is None or (not rows and found == 1.0):
            continue
        if not rows:
            raise refuse(key, found, f"a logits transform whose effect {ENGINE} gives for other architectures "
                                     f"only (not known for {architecture or 'a config without architectures'})")
        if rows[0].action != APPLIED:
            raise refuse(key, found, f"{ENGINE} applies {rows[0].does}")
        scale *= factor(key, architecture, found, value, source)
    return scale


def factor(key: str, architecture: str, found: Any, value: Any, source: str) -> float:
    """One applied row's multiplier of the logits, checked finite and non-zero."""
    number = nonzero_number(key, found, source)
    if key == "logits_scaling" and architecture not in HYPERCLOVAX:
        return 1.0 / number
    if key == "output_mult":
        if not value("use_mup", False):
            return 1.0  # TeleFLM scales only under muP
        return number / nonzero_number("mup_scale_factor", value("mup_scale_factor"), source)
    return number


def nonzero_number(key: str, found: Any, source: str) -> float:
    if not isinstance(found, (int, float)) or not finite(found) or found == 0:  # an int no float holds too
        raise ValueError(f"TeacherHead.from_hf: {source!r}'s config.json sets {key}={shown(found)}; a logits "
                         "multiplier must be a finite non-zero number")
    return float(found)
