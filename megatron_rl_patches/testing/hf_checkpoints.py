"""Tiny Hugging Face checkpoints made on the spot, nothing downloaded: with transformers' own
classes (`save_tiny_hf`: the model is the reference forward), or without transformers from a
config dict and random tensors (`write_tiny_checkpoint`: for loader and layout tests). Every
tensor is random (a norm left at 1 or a bias at 0 would hide a mis-mapped one)."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch

from megatron_rl_patches.inference.loading.hf.checkpoint_config import text_config
from megatron_rl_patches.inference.loading.hf.families import FAMILIES, REGISTRY, architecture
from megatron_rl_patches.inference.loading.hf.files import read_tensor, tensor_index
from megatron_rl_patches.inference.loading.hf.names import checkpoint_tensors

HF_KINDS = tuple(family.name for family in FAMILIES)  # the converter's families, one config each

WRAPPERS = ("qwen3_5", "qwen3_5_moe")  # saved as vision-language wrappers around their text model
TINY_VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 32}

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


def tiny_hf_config(kind: str = "qwen3", **overrides: Any) -> dict[str, Any]:
    """A config.json dict of a tiny model of `kind`: 2 layers, hidden 32, 4 query and 2 key/value
    heads, vocab 1001 (not a multiple of 128: Megatron pads it), untied output layer, and the
    family's own fields (its `tiny_fields`)."""
    if kind not in HF_KINDS:
        raise ValueError(f"kind must be one of {HF_KINDS}, got {kind!r}")
    config: dict[str, Any] = dict(
        model_type=kind, vocab_size=1001, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
        max_position_embeddings=64, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        hidden_act="silu", dtype="float32",
    )
    for name, value in REGISTRY[kind].tiny_fields.items():
        if value is None:
            config.pop(name, None)
        else:
            config[name] = value
    config.update(overrides)
    return config


def transformers_layout(config: dict[str, Any]) -> dict[str, Any]:
    """config.json as transformers writes the model a `tiny_hf_config` dict describes: a wrapper's
    (WRAPPERS: Qwen3.5) text model nested under `text_config` (its model_type `<kind>_text`), the
    wrapper's model_type, tie_word_embeddings and dtype beside it; other kinds as they are. No vision
    tower (`save_tiny_hf` saves one; the builder skips it)."""
    kind = config.get("model_type")
    if kind not in WRAPPERS:
        return dict(config)
    text = {name: value for name, value in config.items() if name not in ("model_type", "dtype")}
    outer = {"model_type": kind, "tie_word_embeddings": text.get("tie_word_embeddings", False)}
    if "dtype" in config:
        outer["dtype"] = config["dtype"]
    return {**outer, "text_config": {**text, "model_type": f"{kind}_text"}}


def write_safetensors(file: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file of `tensors` (contiguous CPU tensors of a float dtype)."""
    header: dict[str, Any] = {}
    blobs, offset = [], 0
    for name, tensor in tensors.items():
        data = tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(file, "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def write_tiny_checkpoint(directory: str | Path, config: dict[str, Any], seed: int = 0,
                          shards: int = 1) -> dict[str, torch.Tensor]:
    """config.json and random safetensors weights (in `shards` files with an index when > 1) of
    the architecture `config` describes, into `directory`; returns the tensors. No transformers."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        name: torch.randn(shape, generator=gen) * 0.2 + (1.0 if len(shape) == 1 else 0.0)
        for name, shape in checkpoint_tensors(architecture(config)).items()
    }
    (root / "config.json").write_text(json.dumps(config))
    if shards == 1:
        write_safetensors(root / "model.safetensors", tensors)
        return tensors
    names = list(tensors)
    weight_map = {}
    for index in range(shards):
        file = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = names[index::shards]
        write_safetensors(root / file, {name: tensors[name] for name in part})
        weight_map.update({name: file for name in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def save_tiny_hf(directory: str | Path, kind: str = "qwen3", seed: int = 0, **overrides: Any) -> Any:
    """A tiny transformers model of `kind` (config as tiny_hf_config), every parameter random,
    saved with save_pretrained into `directory`; returns the model (float32, eval) as the reference
    (MiMo: save_tiny_mimo's Qwen2).
    Needs transformers."""
    import transformers  # lazy: optional dependency transformers

    if kind == "mimo":  # remote code: no transformers class of its own
        return save_tiny_mimo(directory, seed, **overrides)
    values = tiny_hf_config(kind, **overrides)
    model_type = values.pop("model_type")
    values.pop("dtype")
    classes = REGISTRY[model_type].hf_class
    config_class, model_class = f"{classes}Config", f"{classes}ForCausalLM"
    if model_type in WRAPPERS:  # a vision-language wrapper: the text config nested, a tiny vision tower beside
        model_class = f"{classes}ForConditionalGeneration"
        values = {"text_config": values, "vision_config": TINY_VISION,
                  "tie_word_embeddings": values.get("tie_word_embeddings", False)}
    elif classes.endswith("Text"):  # the text model of a wrapper: its config class, the wrapper's LM class
        model_class = f"{classes.removesuffix('Text')}ForCausalLM"
    config = getattr(transformers, config_class)(**values)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * 0.2 + _centre(name, param))
        saved = model.state_dict()
        for name, buffer in model.named_buffers():  # the checkpoint's buffers too: a router's expert bias
            if name in saved and buffer.is_floating_point():
                buffer.copy_(torch.randn_like(buffer) * 0.2)
    model.save_pretrained(directory)
    return model


# linear attention's decay exp(-exp(A_log) softplus(a + dt_bias)) per step: random around a trained
# model's (near 1), not around 1 (e^-3.5 per step underflows float32 within a chunk of 64 in
# transformers' own float32 forward, then noise of 1e-4 even against its float64 forward)
_CENTRES = {"A_log": -1.0, "dt_bias": -2.0}


def _centre(name: str, param: torch.Tensor) -> float:
    """Where a random parameter is drawn around: a norm's weight and a bias at 1, a matrix at 0."""
    return _CENTRES.get(name.rsplit(".", 1)[-1], 1.0 if param.ndim == 1 else 0.0)


def add_mtp_tensors(directory: str | Path, prefix: str, **config: Any) -> None:
    """The multi-token prediction tensors a real checkpoint stores and `save_pretrained` of a tiny
    model does not (a few of them, random, under `prefix`: `model.layers.N.` for GLM / DeepSeek,
    `model.mtp_layers.0.` for MiMo) added to the single-file checkpoint at `directory`, and
    `config` written into its config.json."""
    from safetensors.torch import load_file  # lazy: optional dependency safetensors

    root = Path(directory)
    values = json.loads((root / "config.json").read_text())
    values.update(config)
    (root / "config.json").write_text(json.dumps(values))

    h = text_config(values)["hidden_size"]  # a wrapper nests it
    tensors = load_file(root / "model.safetensors")
    tensors.update({prefix + "enorm.weight": torch.randn(h), prefix + "hnorm.weight": torch.randn(h),
                    prefix + "eh_proj.weight": torch.randn(h, 2 * h)})
    write_safetensors(root / "model.safetensors", tensors)


def save_tiny_mimo(directory: str | Path, seed: int = 0, **overrides: Any) -> Any:
    """MiMo (remote code, no transformers class): a tiny Qwen2 checkpoint whose config.json says
    `mimo`, with MTP tensors under model.mtp_layers.0.; returns the Qwen2 model (the reference)."""
    model = save_tiny_hf(directory, "qwen2", seed=seed, **overrides)
    add_mtp_tensors(directory, "model.mtp_layers.0.", model_type="mimo", architectures=["MiMoForCausalLM"],
                    num_nextn_predict_layers=1)
    return model


def router_margin(model: Any, tokens: torch.Tensor) -> float:
    """The smallest gap, over the tokens and MoE layers of a transformers model's forward, between
    the last expert chosen and the first one not chosen in the scores its router ranks (GLM: also
    between the last group kept and the first dropped): a seed whose margin is under 1e-3 could
    route differently under another summation order, so reference tests pick seeds above it."""
    margins = []

    def hook(module: Any, args: tuple[Any, ...]) -> None:
        x = args[0].reshape(-1, args[0].shape[-1]).double()
        logits = x @ module.weight.double().t()
        k = model.config.get_text_config().num_experts_per_tok
        if hasattr(module, "e_score_correction_bias"):  # glm4_moe: sigmoid + bias, ranked within kept groups
            ranked = logits.sigmoid() + module.e_score_correction_bias.double()
            groups = ranked.view(len(ranked), module.num_group, -1).topk(2, dim=-1)[0].sum(-1)
            top_groups = groups.topk(module.topk_group + 1, dim=-1)[0]
            margins.append((top_groups[:, -2] - top_groups[:, -1]).min().item())
            keep = groups.topk(module.topk_group, dim=-1)[1]
            per_group = ranked.shape[1] // module.num_group
            mask = torch.zeros_like(groups).scatter_(1, keep, 1.0).repeat_interleave(per_group, 1)
            ranked = ranked.masked_fill(mask == 0, -1e9)
        else:
            ranked = logits
        top = ranked.topk(k + 1, dim=-1)[0]
        margins.append((top[:, k - 1] - top[:, k]).min().item())

    handles = [m.register_forward_pre_hook(hook) for name, m in model.named_modules()
               if name.endswith(".gate") and hasattr(m, "weight") and m.weight.shape[0] > 1]
    with torch.no_grad():
        model(tokens)
    for handle in handles:
        handle.remove()
    return min(margins, default=float("inf"))


def write_swapped_layers(good: str | Path, bad: str | Path) -> None:
    """The checkpoint directory `good` with layers 0 and 1 exchanged, written to `bad` (a negative
    control: a loader that maps layers by position passes it)."""
    swapped = {}
    for name, entry in tensor_index(Path(good)).items():
        for a, b in ((".0.", ".1."), (".1.", ".0.")):
            if name.startswith(f"model.layers{a}"):
                name = name.replace(f"model.layers{a}", f"model.layers{b}", 1)
                break
        swapped[name] = read_tensor(entry)
    Path(bad).mkdir(parents=True)
    (Path(bad) / "config.json").write_bytes((Path(good) / "config.json").read_bytes())
    write_safetensors(Path(bad) / "model.safetensors", swapped)


def save_word_tokenizer(directory: str | Path, vocab_size: int) -> None:
    """A word-level tokenizer of `vocab_size` words "t0" .. "t{vocab_size-1}" (id i spells "ti"),
    split on whitespace, into `directory` (tokenizer.json and its config): what a server that
    checks ids against its tokenizer (vLLM) needs beside a tiny checkpoint. Needs tokenizers."""
    from tokenizers import Tokenizer, models, pre_tokenizers  # lazy: optional dependency tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    root = Path(directory)
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "unk_token": "t0", "model_max_length": 1 << 20}))
