"""What `shared-prefix check` reads of a model, offline: a Hugging Face config.json, or a Megatron arguments
file (the flags of a slime / Megatron-LM run script). Only the fields and the kinds they imply, never a
weight: multi-latent attention from `kv_lora_rank`, MTP from `num_nextn_predict_layers`, MoE from
`n_routed_experts` / `num_experts`, gated delta nets from `layer_types`, DeepSeek sparse attention from
`index_topk`, a vision-language model from `vision_config`.

The arguments file holds shell words as a run script passes them to slime's or Megatron-LM's
`train.py`: `--flag value` or a bare `--flag`, over any lines (`\\` continuations and `# comments` are
fine; `${VARIABLES}` are not expanded: write values). The flags read are `ARGUMENTS`' (the parallel sizes,
the model's attention, MTP and MoE flags, slime's `--spec`, `--allgather-cp`, routing replay); every
other flag is left alone."""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from megatron_rl_patches.apps.cli._common import UsageError
from megatron_rl_patches.integrations.shared_prefix_doors.offline import ModelFacts, Parallel


def _first(config: dict, *names: str) -> Any:
    return next((config[name] for name in names if config.get(name)), None)


def hf_model(directory: str) -> ModelFacts:
    """The model of a Hugging Face directory's config.json (a vision-language model's `text_config` read as
    its language model)."""
    path = Path(directory) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"--hf-config {directory}: no config.json there (a Hugging Face model folder holds "
                         "one)") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"--hf-config {directory}: config.json cannot be read ({exc})") from exc
    if not isinstance(config, dict):
        raise UsageError(f"--hf-config {directory}: config.json holds {type(config).__name__}, not an object")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    fields: dict[str, Any] = {}
    kinds = []
    if text.get("kv_lora_rank"):
        fields["multi_latent_attention"] = True
        kinds.append("multi-latent attention")
    depth = _first(text, "num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")
    if depth:
        fields["mtp_num_layers"] = int(depth)
        kinds.append(f"MTP depth {int(depth)}")
    experts = _first(text, "n_routed_experts", "num_experts", "num_local_experts")
    if experts:
        fields["num_moe_experts"] = int(experts)
        kinds.append(f"MoE ({int(experts)} experts)")
        if text.get("topk_method") == "noaux_tc":
            fields["moe_router_enable_expert_bias"] = True
    layer_types = [str(kind) for kind in text.get("layer_types") or []]
    gated_delta_net = "linear_attention" in layer_types
    if gated_delta_net:
        kinds.append("gated delta nets")
    window = text.get("sliding_window")
    if window and (text.get("use_sliding_window") or "sliding_attention" in layer_types):
        fields["window_size"] = (int(window), 0)
        kinds.append(f"sliding window {int(window)}")
    if config.get("model_type") == "gpt_oss":
        fields["softmax_type"] = "learnable"
        kinds.append("attention sinks")
    rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
    if isinstance(rope, dict) and ("mrope_section" in rope or rope.get("type") == "mrope"):
        fields["position_embedding_type"] = "mrope"
    for name in ("attention_dropout", "hidden_dropout"):
        if float(text.get(name) or 0.0) > 0:
            fields[name] = float(text[name])
    sparse = bool(text.get("index_topk"))
    if sparse:
        kinds.append("DeepSeek sparse attention")
    vision = "vision_config" in config
    if vision:
        kinds.append("vision-language")
    name = f"{config.get('model_type', '?')} ({', '.join(config.get('architectures') or []) or 'no architectures'})"
    return ModelFacts(name, fields, gated_delta_net=gated_delta_net, sparse_attention=sparse, vision=vision,
                      kinds=tuple(kinds))


@dataclass(frozen=True)
class Argument:
    """A flag of the arguments file: the config field (or layout item) it sets and how its value reads
    (`value` None: the word after the flag, typed; else the flag alone sets `value`)."""

    name: str
    value: Any = None
    layout: bool = False


ARGUMENTS: dict[str, Argument] = {
    "--tensor-model-parallel-size": Argument("tp", layout=True),
    "--context-parallel-size": Argument("cp", layout=True),
    "--pipeline-model-parallel-size": Argument("pp", layout=True),
    "--expert-model-parallel-size": Argument("ep", layout=True),
    "--num-virtual-stages-per-pipeline-rank": Argument("vpp", layout=True),
    "--sequence-parallel": Argument("sp", True, layout=True),
    "--allgather-cp": Argument("cp_layout", "contiguous", layout=True),
    "--use-rollout-routing-replay": Argument("routing_replay", True, layout=True),
    "--use-routing-replay": Argument("routing_replay", True, layout=True),
    "--multi-latent-attention": Argument("multi_latent_attention", True),
    "--no-rope-fusion": Argument("apply_rope_fusion", False),
    "--rotary-interleaved": Argument("rotary_interleaved", True),
    "--mtp-num-layers": Argument("mtp_num_layers"),
    "--num-experts": Argument("num_moe_experts"),
    "--moe-expert-capacity-factor": Argument("moe_expert_capacity_factor"),
    "--moe-router-load-balancing-type": Argument("moe_router_load_balancing_type"),
    "--moe-aux-loss-coeff": Argument("moe_aux_loss_coeff"),
    "--moe-z-loss-coeff": Argument("moe_z_loss_coeff"),
    "--moe-router-enable-expert-bias": Argument("moe_router_enable_expert_bias", True),
    "--moe-router-bias-update-rate": Argument("moe_router_bias_update_rate"),
    "--moe-input-jitter-eps": Argument("moe_input_jitter_eps"),
    "--attention-dropout": Argument("attention_dropout"),
    "--hidden-dropout": Argument("hidden_dropout"),
    "--position-embedding-type": Argument("position_embedding_type"),
    "--experimental-attention-variant": Argument("experimental_attention_variant"),
    "--recompute-granularity": Argument("recompute_granularity"),
}
# slime's own layer specs (`--spec MODULE FUNCTION`): the kinds their layers are
SPECS = {"qwen3_next": "gated_delta_net", "qwen3_5": "gated_delta_net", "glm5": "sparse_attention"}


def _typed(word: str) -> Any:
    for kind in (int, float):
        try:
            return kind(word)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(word.lower(), word)


@dataclass
class ArgumentsRead:
    fields: dict[str, Any] = field(default_factory=dict)
    layout: dict[str, Any] = field(default_factory=dict)
    kinds: set[str] = field(default_factory=set)


def read_arguments(text: str, where: str) -> ArgumentsRead:
    """The fields, layout items and slime spec kinds the flags of `text` set (`where` names the file)."""
    try:
        words = shlex.split(text, comments=True)
    except ValueError as exc:
        raise UsageError(f"--megatron-args {where}: not shell words ({exc})") from exc
    read = ArgumentsRead()
    for index, word in enumerate(words):
        if word == "--spec":
            module = " ".join(words[index + 1:index + 3])
            read.kinds.update(kind for name, kind in SPECS.items() if name in module)
            continue
        argument = ARGUMENTS.get(word)
        if argument is None:
            continue
        if argument.value is not None:
            value = argument.value
        else:
            if index + 1 >= len(words) or words[index + 1].startswith("--"):
                raise UsageError(f"--megatron-args {where}: {word} takes a value")
            value = _typed(words[index + 1])
        (read.layout if argument.layout else read.fields)[argument.name] = value
    return read


def args_model(path: str) -> tuple[ModelFacts, dict[str, Any]]:
    """The model of a Megatron arguments file, and the layout items it sets (sizes, SP, CP cut, replay)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"--megatron-args {path}: cannot be read ({exc.strerror or exc})") from exc
    read = read_arguments(text, path)
    kinds = []
    if read.fields.get("multi_latent_attention"):
        kinds.append("multi-latent attention")
    if read.fields.get("mtp_num_layers"):
        kinds.append(f"MTP depth {read.fields['mtp_num_layers']}")
    if read.fields.get("num_moe_experts"):
        kinds.append(f"MoE ({read.fields['num_moe_experts']} experts)")
    kinds += [{"gated_delta_net": "gated delta nets", "sparse_attention": "DeepSeek sparse attention"}[kind]
              for kind in sorted(read.kinds)]
    model = ModelFacts(Path(path).name, read.fields, gated_delta_net="gated_delta_net" in read.kinds,
                       sparse_attention="sparse_attention" in read.kinds, kinds=tuple(kinds))
    return model, read.layout


def layout_of(items: dict[str, Any], given: dict[str, Any]) -> Parallel:
    """The layout: the arguments file's items, then the command line's sizes (`given`, None: not given)."""
    parallel = replace(Parallel(), **items)
    chosen = {name: value for name, value in given.items() if value is not None}
    for name, value in chosen.items():
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise UsageError(f"--{name} {value}: a parallel size is 1 or more")
    return replace(parallel, **chosen)
