"""The router of GLM-4.5 and DeepSeek-V3 (glm4_moe, deepseek_v3, glm4_moe_lite, kimi_k2): a sigmoid
score per expert with a per-expert correction added for the choice only (`e_score_correction_bias`:
megatron-core's expert_bias), group-limited choice (`n_group` / `topk_group`) and the routed weights
renormalized, then scaled (`routed_scaling_factor`). Those families' typed piece of an HFArchitecture
(`arch.sigmoid_router`; None: the top-k softmax router of the other mixtures of experts), read from
config.json and turned into megatron-core's TransformerConfig fields here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_rl_patches.inference.loading.hf.architecture import read_count, read_field, read_number


@dataclass(frozen=True)
class SigmoidRouter:
    """The experts in `groups` equal groups, a token's experts taken from its best `group_topk`
    groups (all kept: no grouping); the routed experts' weights scaled by `scaling`."""

    groups: int = 1
    group_topk: int = 1
    scaling: float = 1.0

    def config_fields(self) -> dict[str, Any]:
        """megatron-core's TransformerConfig fields of this router (beside moe_config's top-k ones)."""
        values: dict[str, Any] = {
            "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,  # the bias buffer; never updated in inference
            "moe_router_dtype": "fp32",  # transformers scores a sigmoid router in float32 at any dtype
        }
        if self.group_topk < self.groups:  # all groups kept: no grouping at all
            values.update(moe_router_num_groups=self.groups, moe_router_group_topk=self.group_topk)
        if self.scaling != 1.0:
            values["moe_router_topk_scaling_factor"] = self.scaling
        return values


def read_groups(config: dict[str, Any], source: str) -> tuple[int, int]:
    """(n_group, topk_group): the routed experts in n_group equal groups, a token's experts taken from
    its best topk_group groups; a ValueError naming the field where transformers or megatron-core
    cannot route so (an assertion, a division by zero, or a build transformers refuses)."""
    groups = read_count(config, source, "n_group", default=1)
    group_topk = read_count(config, source, "topk_group", default=1)
    experts = read_count(config, source, "n_routed_experts")
    if experts % groups:
        raise ValueError(f"{source}: config.json's n_group={groups} does not divide n_routed_experts={experts}; "
                         "the experts are routed in n_group equal groups: n_group must be a divisor of it")
    if group_topk > groups:
        raise ValueError(f"{source}: config.json's topk_group={group_topk} exceeds n_group={groups}; a token's "
                         f"experts come from its best topk_group of the n_group groups: set topk_group in 1..{groups}")
    return groups, group_topk


def read_routed_scaling(config: dict[str, Any], source: str) -> float:
    """routed_scaling_factor (1.0 where config.json writes none): a positive number."""
    return read_number(config, source, "routed_scaling_factor",
                       read_field(config, source, "routed_scaling_factor", default=1.0))


def router_problems(config: dict[str, Any], groups: int, group_topk: int) -> list[str]:
    """What megatron-core does not route as transformers does: group-limited routing where megatron-core
    scores a group by its top num_experts_per_tok // topk_group experts (transformers by its top 2),
    and weights left unnormalized (megatron-core's sigmoid router always renormalizes)."""
    problems = []
    topk = config.get("num_experts_per_tok")
    if group_topk < groups and isinstance(topk, int) and topk // group_topk != 2:
        problems.append(f"n_group={groups} with topk_group={group_topk} and num_experts_per_tok={topk} "
                        "(megatron-core scores a group by its top num_experts_per_tok // topk_group experts, "
                        "transformers by its top 2)")
    if config.get("norm_topk_prob") is False:
        problems.append("norm_topk_prob=false (megatron-core's sigmoid router always renormalizes)")
    return problems
