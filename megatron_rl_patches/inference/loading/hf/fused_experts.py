"""Experts stored stacked, as Qwen3.5-MoE's published checkpoints store them (transformers 5's own
layout: `mlp.experts.gate_up_proj` [experts, 2 x ffn, hidden], gate rows first, and
`mlp.experts.down_proj` [experts, hidden, ffn]), seen as the per-expert tensors the families map
(`mlp.experts.N.gate_proj.weight`, `up_proj`, `down_proj`): each a part of the stacked tensor
(rows of one expert, read alone), so nothing is read until a shard needs it, one expert at a time."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture
from megatron_rl_patches.inference.loading.hf.files import TensorEntry, tensor_index

_STACKED = re.compile(r"^(.*\.mlp\.experts\.)(gate_up_proj|down_proj)$")


def _rows(entry: TensorEntry, expert: int, first: int, rows: int) -> TensorEntry:
    """Rows [first, first + rows) of `expert`'s slab of a stacked [experts, rows, columns] tensor."""
    return dataclasses.replace(entry, shape=(rows, entry.shape[2]), part=(expert, first, first + rows))


def per_expert_views(index: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    """`index` with each stacked expert tensor replaced by its per-expert views (others unchanged)."""
    out: dict[str, TensorEntry] = {}
    for name, entry in index.items():
        match = _STACKED.match(name)
        if match is None or len(entry.shape) != 3:
            out[name] = entry
            continue
        prefix, kind = match.groups()
        experts, rows, _ = entry.shape
        for expert in range(experts):
            if kind == "down_proj":
                out[f"{prefix}{expert}.down_proj.weight"] = _rows(entry, expert, 0, rows)
            else:  # gate then up, each half of the expert's rows
                half = rows // 2
                out[f"{prefix}{expert}.gate_proj.weight"] = _rows(entry, expert, 0, half)
                out[f"{prefix}{expert}.up_proj.weight"] = _rows(entry, expert, half, half)
    return out


def readable_index(root: Path, arch: HFArchitecture) -> dict[str, TensorEntry]:
    """The checkpoint's tensors as its family maps them (stacked experts as per-expert views)."""
    index = tensor_index(root)
    return per_expert_views(index) if arch.family.stacked_experts else index
