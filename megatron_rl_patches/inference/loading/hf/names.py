"""The tensors a Hugging Face checkpoint of an HFArchitecture holds (name -> shape), derived from
config.json alone through its family: the loader checks a checkpoint against it before reading
any weight, and the memory planner counts parameters from it."""
from __future__ import annotations

from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture
from megatron_rl_patches.inference.loading.hf.families import family_for
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
    """One decoder layer's tensors (`family`: default the one of `arch.model_type`)."""
    family = family or family_for(arch.model_type, arch.source)
    prefix = family.layer_prefix.format(layer=layer)
    return {prefix + name: shape for name, shape in per_expert(family.layer_tensors(arch, layer),
                                                               arch.num_experts).items()}


def checkpoint_tensors(arch: HFArchitecture, family: Family | None = None) -> dict[str, Shape]:
    """Every tensor of the checkpoint, by name (the output layer only when untied)."""
    family = family or family_for(arch.model_type, arch.source)
    before, after = family.outer_tensors(arch)
    out = dict(before)
    for layer in range(arch.num_layers):
        out.update(layer_tensors(arch, layer, family))
    out.update(after)
    return out

