"""The tensors a Hugging Face checkpoint of an HFArchitecture holds (name -> shape), derived from
config.json alone through its family: the loader checks a checkpoint against it before reading
any weight, and the memory planner counts parameters from it."""
from __future__ import annotations

import re
from typing import Any

from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture
from megatron_rl_patches.inference.loading.hf.families.family import EXPERT, Family, Shape

# tensors some exporters write that carry no weights (recomputed by the model)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def per_expert(names: dict[str, Shape], experts: int) -> dict[str, Shape]:
    """`names` with each run of `{e}` names written out for every expert (expert by expert)."""
    out: dict[str, Shape] = {}
    run: list[tuple[str, Shape]] = []
    for name, shape in [*names.items(), ("", ())]:  # the sentinel ends the last run
        if EXPERT in name:
            run.append((name, shape))
            continue
        for expert in range(experts):
            out.update((template.replace(EXPERT, str(expert)), dims) for template, dims in run)
        run = []
        if name:
            out[name] = shape
    return out


def layer_tensors(arch: HFArchitecture, layer: int, family: Family | None = None) -> dict[str, Shape]:
    """One decoder layer's tensors (`family`: default the one `arch` was read by, `arch.family`)."""
    family = family or arch.family
    prefix = family.layer_prefix.format(layer=layer)
    return {prefix + name: shape for name, shape in per_expert(family.layer_tensors(arch, layer),
                                                               arch.num_experts).items()}


def checkpoint_tensors(arch: HFArchitecture, family: Family | None = None) -> dict[str, Shape]:
    """Every tensor of the checkpoint, by name (the output layer only when untied)."""
    family = family or arch.family
    before, after = family.outer_tensors(arch)
    out = dict(before)
    for layer in range(arch.num_layers):
        out.update(layer_tensors(arch, layer, family))
    out.update(after)
    return out


def check_counts(arch: HFArchitecture, index: dict[str, Any], family: Family | None = None) -> None:
    """ValueError naming config.json's num_hidden_layers / num_experts where the checkpoint's
    tensor names hold fewer layers or experts: checked before any per-tensor list of config.json's
    counts is made (a config claiming 10**9 layers would exhaust memory). Stray extra tensors are
    the tensor check's (WeightsMismatchError lists them)."""
    family = family or arch.family
    layer = re.compile(re.escape(family.layer_prefix).replace(re.escape("{layer}"), r"(\d+)"))
    layers = {int(m.group(1)) for name in index if (m := layer.match(name))}
    found = max(layers) + 1 if layers else 0
    if found < arch.num_layers:
        raise ValueError(f"{arch.source}: config.json's num_hidden_layers={arch.num_layers} but the checkpoint holds "
                         f"{found} layers; the config and the weights belong to different models")
    if arch.is_moe:
        expert = re.compile(r"\.experts\.(\d+)\.")
        experts = {int(m.group(1)) for name in index if (m := expert.search(name))}
        held = max(experts) + 1 if experts else 0
        if held < arch.num_experts:
            raise ValueError(f"{arch.source}: config.json's num_experts={arch.num_experts} but the checkpoint holds "
                             f"{held} experts per layer; the config and the weights belong to different models")
