"""Per-GPU weight bytes of a Hugging Face checkpoint's inference-only build at TP / PP / EP, per
residency mode, from config.json alone (`megatron-rl-patches memory --hf`): plan a 27B or a
235B-A22B teacher before downloading its weights. Imports nothing heavy (no torch).

Per GPU, one formula over the family's parameter map: a layer's parameters of a fuse kind that
splits (`FuseKind.split`: row, gated, qkv...) are divided over TP, the others (replicate: norms,
router) are whole on every rank, a kind's own share where it says one (`FuseKind.rank_params`:
q/k/v with each key/value head repeated where TP exceeds them, one whole head per rank), experts
are divided over EP, then over TP (megatron-core's expert tensor-parallel size defaults to TP); the
first pipeline stage holds the embedding and the last the output layer (a tied output layer is a
second copy when PP > 1), both of Megatron's padded vocab (a multiple of 128 x TP). Residency as in
inference/sizing/residency_plan.py, on the pipeline stage that holds the most."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from math import prod
from pathlib import Path
from typing import Any

from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture
from megatron_rl_patches.inference.loading.hf.families import read_architecture, split_problems
from megatron_rl_patches.inference.loading.hf.families.family import EXPERT, Family
from megatron_rl_patches.inference.loading.hf.fused_experts import readable_index
from megatron_rl_patches.inference.loading.hf.names import check_counts
from megatron_rl_patches.inference.sizing.memory import DTYPE_BYTES, dtype_name
from megatron_rl_patches.inference.sizing.residency_plan import ResidencyBytes
from megatron_rl_patches.ops.scoring_plan import positive_int

VOCAB_DIVISOR = 128  # Megatron-LM's default make_vocab_size_divisible_by


@dataclass(frozen=True)
class HFMemoryPlan:
    """Parameters and bytes per GPU (the pipeline stage holding the most) for one layout."""

    source: str
    model_type: str
    total_params: int  # the checkpoint's, unpadded
    active_params: int  # per token: a MoE layer runs experts_per_token of its experts
    padded_vocab: int
    tp: int
    pp: int
    ep: int
    param_dtype: str
    prefetch: int
    layers_per_stage: int
    layer_params: int  # one layer, per GPU
    embedding_params: int  # per GPU of the first stage
    output_params: int  # per GPU of the last stage (the output layer and the final norm)
    stage_params: tuple[int, ...]  # per GPU, by pipeline stage
    modes: tuple[ResidencyBytes, ...]
    vision_params: int = 0  # a vision-language checkpoint's vision tower: not built, not in total_params

    @property
    def gpu_params(self) -> int:
        return max(self.stage_params)

    def mode(self, name: str) -> ResidencyBytes:
        return next(m for m in self.modes if m.mode == name)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(gpu_params=self.gpu_params, modes={m.mode: m.as_dict() for m in self.modes})
        return data


@dataclass(frozen=True)
class LayerParams:
    """One decoder layer's parameters: per GPU at (tp, ep), and its experts' (all, active per token)."""

    per_gpu: int
    experts: int
    active_experts: int


def layer_params(arch: HFArchitecture, layer: int, tp: int = 1, ep: int = 1, family: Family | None = None
                 ) -> LayerParams:
    """The layer's parameters from the family's tensors and the fuse kind of each Megatron parameter
    (KeyError naming a tensor a parameter is made of that the layer does not hold)."""
    family = family or arch.family
    tensors = family.layer_tensors(arch, layer)
    split = whole = expert = own = 0
    for param in family.layer_params(arch, layer).values():
        sizes = [prod(tensors[name]) for name in param.hf]
        size, held = sum(sizes), param.kind.rank_params(arch, sizes, tp)
        if param.expert:
            expert += size  # one expert's
        elif held is not None:  # a kind's own share (key/value heads repeated at tp: kv_heads.py)
            own += held
        elif param.kind.split:
            split += size
        else:
            whole += size
    per_gpu = -(-split // tp) + whole + own + (arch.num_experts // ep) * -(-expert // tp)
    return LayerParams(per_gpu, arch.num_experts * expert, arch.experts_per_token * expert)


def _layer_total(arch: HFArchitecture, family: Family, layer: int = 0) -> int:
    """One layer's parameters in the checkpoint, its expert templates counted once per expert."""
    return sum(prod(shape) * (arch.num_experts if EXPERT in name else 1)
               for name, shape in family.layer_tensors(arch, layer).items())


def layer_runs(arch: HFArchitecture) -> list[tuple[int, int]]:
    """The layers as runs [start, end) of alike ones. Counted, not listed, where config.json only
    counts layers (it may claim 10**9): the dense first ones (`dense_layers`) and the others; where
    it lists a type per layer (`layer_types`: linear / full attention), runs of one type."""
    dense = min(arch.dense_layers, arch.num_layers)
    edges = {0, dense, arch.num_layers}
    edges.update(i for i in range(1, len(arch.layer_types)) if arch.layer_types[i] != arch.layer_types[i - 1])
    bounds = sorted(edges)
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def check_counts_if_present(arch: HFArchitecture) -> None:
    """Where the weight files are already there, config.json's layer and expert counts checked
    against them (headers only): a config claiming more than the files hold is named, not planned."""
    root = Path(arch.source).expanduser()
    if not root.is_dir():
        return
    try:
        index = readable_index(root, arch)
    except (OSError, ValueError, ImportError):  # no weights yet, an incomplete download, no safetensors library:
        return  # plan from config.json
    check_counts(arch, index)


def hf_memory_plan(
    path: str | os.PathLike[str], *, tp: int = 1, pp: int = 1, ep: int = 1, param_dtype: Any = "bf16",
    prefetch: int = 1,
) -> HFMemoryPlan:
    """The plan for the checkpoint directory at `path` (its config.json alone will do: weight files,
    where present, are checked against it)."""
    arch = read_architecture(path, sizing=True)  # RoPE scaling changes no byte: sized, not refused
    tp, pp, ep = (positive_int(name, value) for name, value in (("tp", tp), ("pp", pp), ("ep", ep)))
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0 (layers copied ahead), got {prefetch!r}")
    problems = split_problems(arch, tp, pp, ep)  # the builder's own check: no plan for a layout it refuses
    if problems:
        raise ValueError(f"{arch.source}: {'; '.join(problems)}; choose parallel sizes this model serves")
    check_counts_if_present(arch)
    size = DTYPE_BYTES[dtype_name(param_dtype, "param_dtype")]
    family = arch.family
    runs = [(start, end, layer_params(arch, start, tp, ep, family)) for start, end in layer_runs(arch)]
    outer = sum(prod(shape) for part in family.outer_tensors(arch) for shape in part.values())
    total = outer + sum((end - start) * _layer_total(arch, family, start) for start, end, _ in runs)
    routed_off = sum((end - start) * (p.experts - p.active_experts) for start, end, p in runs)
    layer = max(p.per_gpu for _, _, p in runs)  # the largest (a MoE layer where the first ones are dense)
    vocab = -(-arch.vocab_size // (VOCAB_DIVISOR * tp)) * VOCAB_DIVISOR * tp
    table = vocab // tp * arch.hidden_size
    embedding = table
    output = (0 if arch.tied and pp == 1 else table) + arch.hidden_size  # + the final norm
    per_stage = -(-arch.num_layers // pp)
    stages = []
    for stage in range(pp):
        ends = (embedding if stage == 0 else 0) + (output if stage == pp - 1 else 0)
        start, end = stage * per_stage, min((stage + 1) * per_stage, arch.num_layers)
        stages.append(sum(max(0, min(end, b) - max(start, a)) * p.per_gpu for a, b, p in runs) + ends)
    weights = max(stages) * size
    stream = max(
        min(stages[s] * size, (min(prefetch, per_stage - 1) + 1) * layer * size
            + max(embedding if s == 0 else 0, output if s == pp - 1 else 0) * size)
        for s in range(pp)
    )
    return HFMemoryPlan(
        source=str(path), model_type=arch.model_type, total_params=total,
        active_params=total - routed_off, padded_vocab=vocab,
        tp=tp, pp=pp, ep=ep, param_dtype=dtype_name(param_dtype, "param_dtype"), prefetch=prefetch,
        layers_per_stage=per_stage, layer_params=layer, embedding_params=embedding, output_params=output,
        stage_params=tuple(stages),
        modes=(ResidencyBytes("resident", weights, weights, 0), ResidencyBytes("swap", weights, 0, weights),
               ResidencyBytes("stream", stream, 0, weights)),
        vision_params=arch.vision_params,
    )
