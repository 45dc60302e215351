"""What a served engine does to the logits after the final hidden states it pools
(`HEAD_TRANSFORMS`, `head_logit_scale`): vLLM 0.32's pooling runner sends the states its model's
forward returns, and its `compute_logits` then projects them through the output layer and, per
model family, scales or soft-caps the logits (`LogitsProcessor(scale=..., soft_cap=...)`). A
`TeacherHead` must form the same logits from the same states: a scale s is applied (the head's
weight read times s: h·(sW)ᵀ = s·h·Wᵀ, for every route that projects through `head.weight`); a
soft cap or a bias on the output layer is refused by name; a multiplier applied inside the forward
(MiniCPM's) is in the pooled states already. A transform field this table does not know for the
checkpoint's architecture is refused by name (what the engine does with it is not known here).

Each applied field is read where the engine's model file reads it (`HeadTransform.reads`, the file
named in `files`, vllm/model_executor/models/ of vLLM 0.32): most read `hf_config`, config.json as
written (`OUTER`: a wrapper's `text_config` holding the field does not count: Aria's aria.py reads
its wrapper's `logit_scale`); EXAONE MoE reads `hf_config.get_text_config()` (`TEXT`: the
`text_config` where there is one, else config.json). A refused field is refused wherever it is
written (`EITHER`): refusing one the engine would not read is safe, serving one it reads is not.
Standard library only."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from megatron_rl_patches.teachers.finite import finite, shown

APPLIED, REFUSED, IN_STATES = "applied", "refused", "in the pooled states"
# where the engine reads a field: config.json as written (vLLM's hf_config), its language model's
# config (hf_config.get_text_config(): the text_config where there is one), or (refusals) either
OUTER, TEXT, EITHER = "config.json", "text_config", "either"


@dataclass(frozen=True)
class HeadTransform:
    """One row: config.json's `key` read by vLLM 0.32 for the `architectures` (config.json's
    `architectures[0]`, vLLM's model class; () for every architecture), what the engine `does`
    with it, the package's `action`, the value the engine sees where the config it reads omits the
    key (transformers' config default for those architectures; None: no transform), where it
    `reads` the key (`OUTER`, `TEXT`; `EITHER` for a refusal) and the vLLM model `files` that do."""

    key: str
    architectures: tuple[str, ...]
    family: str
    does: str
    action: str
    default: float | None = None
    reads: str = OUTER
    files: tuple[str, ...] = ()


LLAMA_FILES = {  # the architectures that read logit_scale from hf_config, by vLLM 0.32's model file
    "llama.py": ("LlamaForCausalLM", "LLaMAForCausalLM", "InternLM3ForCausalLM", "IQuestCoderForCausalLM",
                 "TeleChat3ForCausalLM"),
    "apertus.py": ("ApertusForCausalLM",),
    "exaone.py": ("ExaoneForCausalLM",),
    "exaone4.py": ("Exaone4ForCausalLM",),
    "nemotron.py": ("NemotronForCausalLM",),
    "nemotron_nas.py": ("DeciLMForCausalLM",),
    "solar.py": ("SolarForCausalLM",),
    "aria.py": ("AriaForConditionalGeneration",),
}
LLAMA_LIKE = tuple(name for names in LLAMA_FILES.values() for name in names)
EXAONE_MOE = ("ExaoneMoeForCausalLM", "ExaoneMoEForCausalLM")
COHERE = ("CohereForCausalLM", "Cohere2ForCausalLM", "Cohere2MoeForCausalLM")
GRANITE_DENSE = ("GraniteForCausalLM", "GraniteSWAForCausalLM")
GRANITE = (*GRANITE_DENSE, "GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM", "GraniteMoeSWAForCausalLM",
           "GraniteMoeHybridForCausalLM")
HYPERCLOVAX = ("HyperCLOVAXForCausalLM",)

HEAD_TRANSFORMS: tuple[HeadTransform, ...] = (
    HeadTransform("logit_scale", LLAMA_LIKE + GRANITE_DENSE + HYPERCLOVAX,
                  "Llama, Apertus, EXAONE, EXAONE 4, Nemotron, DeciLM, Solar, Aria, Granite, HyperCLOVAX",
                  "logits × logit_scale", APPLIED, files=(*LLAMA_FILES, "granite.py", "hyperclovax.py")),
    HeadTransform("logit_scale", EXAONE_MOE, "EXAONE MoE", "logits × logit_scale (its text_config's)", APPLIED,
                  reads=TEXT, files=("exaone_moe.py",)),
    HeadTransform("logit_scale", COHERE, "Cohere (Command R), Cohere 2, Cohere 2 MoE",
                  "logits × logit_scale (0.0625 where config.json omits it)", APPLIED, 0.0625,
                  files=("commandr.py", "cohere2_moe.py")),
    HeadTransform("logits_scaling", GRANITE, "Granite, Granite MoE (shared, hybrid)", "logits ÷ logits_scaling",
                  APPLIED, files=("granite.py", "granitemoe.py", "granitemoeshared.py", "granitemoehybrid.py")),
    HeadTransform("logits_scaling", HYPERCLOVAX, "HyperCLOVAX", "logits × logits_scaling (muP)", APPLIED,
                  files=("hyperclovax.py",)),
    HeadTransform("lm_head_multiplier", ("FalconH1ForCausalLM",), "Falcon-H1", "logits × lm_head_multiplier",
                  APPLIED, files=("falcon_h1.py",)),
    HeadTransform("output_mult", ("TeleFLMForCausalLM",), "TeleFLM",
                  "logits × output_mult ÷ mup_scale_factor when use_mup", APPLIED, files=("teleflm.py",)),
    HeadTransform("final_logit_softcapping", (), "Gemma 2, Gemma 3, Gemma 3n, Gemma 4, Rnj-1, MuseGlimmer",
                  "logits → cap·tanh(logits / cap) (Gemma 2 and 3n: cap 30 where config.json omits it)", REFUSED,
                  reads=EITHER,
                  files=("gemma2.py", "gemma3.py", "gemma3n.py", "gemma4.py", "rnj1.py", "muse_glimmer.py")),
    HeadTransform("output_multiplier", ("MuseGlimmerForCausalLM", "MuseGlimmerForConditionalGeneration"),
                  "MuseGlimmer", "logits × output_multiplier, then soft-capped", REFUSED, reads=EITHER,
                  files=("muse_glimmer.py",)),
    HeadTransform("lm_head.bias", (), "GPT-J, PhiMoE", "logits + the output layer's bias (a tensor, not a field)",
                  REFUSED, reads=EITHER, files=("gpt_j.py", "phimoe.py")),
    HeadTransform("dim_model_base", ("MiniCPMForCausalLM", "MiniCPM3ForCausalLM"), "MiniCPM, MiniCPM3",
                  "states ÷ (hidden_size / dim_model_base) inside the forward, before the states are pooled",
                  IN_STATES, reads=EITHER, files=("minicpm.py",)),  # minicpm3.py's class is minicpm.py's
)
# where config.json omits the soft cap, transformers' default for these architectures sets one
SOFTCAP_DEFAULTS = {"Gemma2ForCausalLM": 30.0, "Gemma3nForCausalLM": 30.0, "Gemma3nForConditionalGeneration": 30.0,
                    "MuseGlimmerForCausalLM": 20.0, "MuseGlimmerForConditionalGeneration": 20.0}
# the architectures whose vLLM 0.32 model projects through its input embeddings whatever config.json
# says (commandr.py and cohere2_moe.py drop a stored lm_head.weight at load), by model file
EMBEDDING_OUTPUT = {
    "commandr.py": ("CohereForCausalLM", "Cohere2ForCausalLM"),
    "cohere2_moe.py": ("Cohere2MoeForCausalLM",),
    "gemma2.py": ("Gemma2ForCausalLM",),
    "gemma3n.py": ("Gemma3nForCausalLM",),
}
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


def projects_through_embeddings(fields: dict[str, Any], text: dict[str, Any]) -> bool:
    """Whether the engine's output layer for this checkpoint is its input embeddings, whatever
    config.json's tie_word_embeddings says (`EMBEDDING_OUTPUT`)."""
    architecture = architecture_of(fields, text)
    return any(architecture in names for names in EMBEDDING_OUTPUT.values())


def head_logit_scale(fields: dict[str, Any], text: dict[str, Any], tensors: Any, source: str) -> float:
    """The factor the engine multiplies the logits by after the output layer for this checkpoint
    (`fields`: config.json as written, `text`: its language model's; `tensors`: the tensor names);
    ValueError naming the field for a transform the head cannot form (see the module's words)."""
    architecture = architecture_of(fields, text)

    def value(key: str, default: float | None = None, reads: str = EITHER) -> Any:
        """`key` where the engine reads it (`reads`), else `default`."""
        for config in {OUTER: (fields,), TEXT: (text,), EITHER: (text, fields)}[reads]:
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
        reads = rows[0].reads if rows and rows[0].action == APPLIED else EITHER
        found = value(key, rows[0].default if rows else None, reads)
        if found is None or (not rows and found == 1.0):
            continue
        if not rows:
            raise refuse(key, found, f"a logits transform whose effect {ENGINE} gives for other architectures "
                                     f"only (not known for {architecture or 'a config without architectures'})")
        if rows[0].action != APPLIED:
            raise refuse(key, found, f"{ENGINE} applies {rows[0].does}")
        scale *= factor(key, architecture, found, functools.partial(value, reads=reads), source)
    return scale


def factor(key: str, architecture: str, found: Any, value: Any, source: str) -> float:
    """One applied row's multiplier of the logits, checked finite and non-zero (`value(name,
    default)`: another field, read from the config the row's key is read from)."""
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
