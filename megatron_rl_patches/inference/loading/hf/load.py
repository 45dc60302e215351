"""Load a Hugging Face checkpoint into inference-only local-spec chunks: the checkpoint's tensor
list checked against config.json before any weight is read, then, parameter by parameter, the
rows of this rank's shard copied from the memory-mapped files straight into their slices of the
parameter (into the host copies of swap/stream builds): no fused or sharded copy is made."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from megatron_rl_patches._log import logger
from megatron_rl_patches.inference.loading.errors import WeightsMismatchError, copying_into_model
from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture
from megatron_rl_patches.inference.loading.hf.checkpoint_config import read_checkpoint_config
from megatron_rl_patches.inference.loading.hf.convert import Source, shard_pieces, source
from megatron_rl_patches.inference.loading.hf.files import TensorEntry, TensorReader, tensor_index, tensor_reader
from megatron_rl_patches.inference.loading.hf.fp8 import SCALE, dequantize, fp8_block, scale_shape
from megatron_rl_patches.inference.loading.hf.fused_experts import readable_index
from megatron_rl_patches.inference.loading.hf.names import IGNORED_SUFFIXES, check_counts, checkpoint_tensors
from megatron_rl_patches.inference.loading.hf.shard_ranks import ShardRanks, parallel_state_ranks
from megatron_rl_patches.inference.residency.placement import weights_on_host
from megatron_rl_patches.model.chunks import module_chunks, unwrap


def checked_index(root: Path, arch: HFArchitecture) -> dict[str, TensorEntry]:
    """The checkpoint's tensors, refused (WeightsMismatchError naming the path) when any expected
    one is missing, an unknown one is present, or a shape differs from config.json's."""
    index = readable_index(root, arch)
    check_counts(arch, index)  # before any list of config.json's tensors is made
    expected = checkpoint_tensors(arch)
    optional = {"lm_head.weight"} if arch.tied else set()  # tied checkpoints may store a copy (see served_tying)
    skipped = arch.family.skipped(arch)  # MTP layers: present or not
    missing = [name for name in expected if name not in index]
    unexpected = [name for name in index if name not in expected and name not in optional
                  and not name.endswith(IGNORED_SUFFIXES) and not (skipped and name.startswith(skipped))]
    shapes = [f"{name} (checkpoint {index[name].shape}, config.json {shape})"
              for name, shape in expected.items() if name in index and index[name].shape != shape]
    shapes += _fp8_problems(root, index, expected, unexpected)
    if missing or unexpected or shapes:
        raise WeightsMismatchError(repr(str(root)), missing, unexpected, shapes)
    return index


def _fp8_problems(root: Path, index: dict[str, TensorEntry], expected: dict[str, tuple[int, ...]],
                  unexpected: list[str]) -> list[str]:
    """An FP8 checkpoint's scales (taken out of `unexpected`): one per block of their weight, and
    every float8 weight has one (the quantization_config is refused by name unless block FP8)."""
    block = fp8_block(read_checkpoint_config(root).fields, repr(str(root)))
    scales = [name for name in unexpected if block and name.endswith(SCALE) and name[:-len(SCALE)] in expected]
    for name in scales:
        unexpected.remove(name)
    problems = [f"{name} (checkpoint {index[name].shape}, one per {block} block: "
                f"{scale_shape(expected[name[:-len(SCALE)]], block)})" for name in scales
                if block and index[name].shape != scale_shape(expected[name[:-len(SCALE)]], block)]
    return problems + [f"{name} (float8 without {name}{SCALE} and a block-FP8 quantization_config)"
                       for name in expected if name in index and index[name].dtype == "F8_E4M3"
                       and not (block and name + SCALE in index)]


def _read(reader: TensorReader, name: str, block: tuple[int, int] | None, dtype: torch.dtype) -> torch.Tensor:
    """One checkpoint tensor as a view of its file; an FP8 weight dequantized into `dtype` by its
    block scales (a new tensor: the one tensor held beyond the model)."""
    if block and name + SCALE in reader.index:
        return dequantize(reader.view(name), reader.view(name + SCALE), block, dtype)
    return reader.view(name)


def served_tying(root: Path, arch: HFArchitecture) -> HFArchitecture:
    """`arch` untied when config.json ties the output layer but the checkpoint stores an
    lm_head.weight that differs from embed_tokens, as transformers 5 serves it (tied, the build
    would score with the embedding: 6 nats off); otherwise `arch` itself."""
    if not arch.tied:
        return arch
    index = tensor_index(root)
    head, embedding = index.get("lm_head.weight"), index.get("model.embed_tokens.weight")
    if head is None or embedding is None or head.shape != embedding.shape:
        return arch
    with tensor_reader(index) as reader:
        same = torch.equal(reader.view(head.name), reader.view(embedding.name))
    if same:
        return arch
    logger.info("megatron-rl-patches: %s ties the output layer in config.json but stores its own lm_head.weight: "
                "served untied, as transformers does", root)
    return dataclasses.replace(arch, tied=False)


def _layer_numbers(module: torch.nn.Module) -> dict[int, int]:
    decoder = getattr(module, "decoder", None)
    layers = getattr(decoder, "layers", [])
    return {i: int(layer.layer_number) - 1 for i, layer in enumerate(layers)}


def _plan(modules: list[torch.nn.Module], arch: HFArchitecture,
          shard: ShardRanks) -> list[tuple[torch.Tensor, str, Source]]:
    family = arch.family
    ep_offset = 0
    if arch.is_moe:
        ep_offset = shard.ep_rank * (arch.num_experts // shard.ep_size)
    plan = []
    for module in modules:
        numbers = _layer_numbers(module)
        for key, target in module.state_dict(keep_vars=True).items():
            if key.endswith("_extra_state") or not isinstance(target, torch.Tensor):
                continue
            plan.append((target, key, source(arch, key, numbers, ep_offset, family)))
    return plan


def load_hf_weights(model: Any, root: Path, arch: HFArchitecture, padded_vocab: int,
                    shard: ShardRanks | None = None) -> None:
    """Copy the checkpoint at `root` into `model` (chunks built from `arch`); everything that can be
    checked without reading weights is checked before the first copy. `shard`: this rank's shard
    positions (default: megatron-core's parallel_state; a teacher's own layout passes its own)."""
    chunks = module_chunks(model, "model")
    index = checked_index(root, arch)
    shard = shard if shard is not None else parallel_state_ranks()
    plan = _plan([unwrap(chunk) for chunk in chunks], arch, shard)
    block = fp8_block(read_checkpoint_config(root).fields, repr(str(root)))
    with torch.no_grad(), weights_on_host(chunks), copying_into_model(root), tensor_reader(index) as reader:
        for target, key, src in plan:
            rank, size = shard.of(src.expert)
            tensors = [_read(reader, name, block, target.dtype) for name in src.hf_names]
            shape, pieces = shard_pieces(arch, src, tensors, rank, size, padded_vocab)
            if shape != tuple(target.shape):
                made = f"{key} from {', '.join(src.hf_names)}"
                raise WeightsMismatchError(repr(str(root)), [], [], [
                    f"{made} (converted {shape}, model {tuple(target.shape)})"])
            for where, value in pieces:
                if value is None:
                    where(target).zero_()
                else:
                    where(target).copy_(value)
            del tensors, pieces  # their views keep file pages mapped
    logger.info("megatron-rl-patches: loaded %d Hugging Face tensors from %s", len(index), root)
