"""The contract every family (families/) keeps, checked from a config.json dict alone (no torch, no
megatron-core): each tensor of a layer makes exactly one Megatron parameter, each parameter's
tensors exist, a fuse kind gets the number of tensors it fuses (its `arity`), and the memory plan's
formula counts what the checkpoint holds. tests/inference/loading/hf/test_families_contract.py runs
it on every registered family (and on broken ones, which it must refuse)."""
from __future__ import annotations

from collections import Counter
from math import prod
from typing import Any

from megatron_rl_patches.inference.loading.hf.families.family import EXPERT, Family, Param, Shape
from megatron_rl_patches.inference.loading.hf.memory_plan import layer_params
from megatron_rl_patches.inference.loading.hf.names import layer_tensors


def _map_problems(where: str, tensors: dict[str, Shape], params: dict[str, Param], once: bool) -> list[str]:
    """Parameters against tensors: sources exist, kinds fuse the right count, each tensor consumed
    exactly once (`once`) or at least once (outside the layers a tied table makes two parameters)."""
    problems = []
    used: Counter[str] = Counter()
    for name, param in params.items():
        used.update(param.hf)
        problems += [f"{where}: parameter {name} is made of {hf}, which is not a tensor of the checkpoint"
                     for hf in param.hf if hf not in tensors]
        if len(param.hf) != param.kind.arity:
            problems.append(f"{where}: parameter {name} of kind {param.kind.name!r} fuses {len(param.hf)} tensors, "
                            f"expected {param.kind.arity}")
        if (EXPERT in name) != param.expert:
            problems.append(f"{where}: parameter {name} and its tensors {param.hf} disagree on being per expert")
    problems += [f"{where}: tensor {name} makes no Megatron parameter" for name in tensors if not used[name]]
    if once:
        problems += [f"{where}: tensor {name} is fused into {count} parameters" for name, count in used.items()
                     if count > 1]
    return problems


def contract_problems(family: Family, config: dict[str, Any]) -> list[str]:
    """What `family` breaks on the checkpoint `config` describes (empty: it keeps the contract)."""
    source = f"{family.name} contract"
    arch = family.architecture(config, source)
    before, after = family.outer_tensors(arch)
    problems = _map_problems("outside the layers", {**before, **after}, family.outer_params(arch), once=False)
    for layer in range(arch.num_layers):
        tensors, params = family.layer_tensors(arch, layer), family.layer_params(arch, layer)
        problems += _map_problems(f"layer {layer}", tensors, params, once=True)
        held = sum(prod(shape) for shape in layer_tensors(arch, layer).values())
        try:
            counted = layer_params(arch, layer).per_gpu
        except KeyError as exc:
            problems.append(f"layer {layer}: the memory plan cannot count parameter tensor {exc}")
            continue
        if counted != held:
            problems.append(f"layer {layer}: the memory plan counts {counted} parameters, the checkpoint holds {held}")
    return problems
