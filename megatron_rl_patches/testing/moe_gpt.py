"""A tiny mixture-of-experts GPTModel for CPU tests: megatron-core's local layer spec with
`num_experts` experts (SequentialMLP, no grouped GEMM), top-k routing and the allgather token
dispatcher (the alltoall dispatcher's split-size all_to_all does not run on gloo). Expert
parallelism comes from Megatron's parallel state (`megatron_world(expert_parallel=...)`); the
CPU shims cover megatron-core < 0.17's MoE router without Transformer Engine."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

from typing import Any

from megatron_rl_patches.testing.megatron_cpu import build_tiny_gpt, tiny_gpt_config

TINY_EXPERTS = 4


def tiny_moe_config(num_experts: int = TINY_EXPERTS, topk: int = 2, expert_parallel: int = 1,
                    **overrides: Any) -> Any:
    """`tiny_gpt_config` with `num_experts` experts routed top-`topk` by the allgather dispatcher,
    no load-balancing loss and no linear biases (the local experts' bias path edits an autograd
    view in place); `expert_parallel` must match the parallel state's."""
    values: dict[str, Any] = dict(
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_ffn_hidden_size=64,
        expert_model_parallel_size=expert_parallel,
        add_bias_linear=False,
    )
    values.update(overrides)
    return tiny_gpt_config(**values)


def moe_layer_spec(num_experts: int = TINY_EXPERTS) -> Any:
    """megatron-core's local GPT layer spec with an MoE MLP of `num_experts` SequentialMLP experts."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)


def build_tiny_moe_gpt(config: Any = None, **kwargs: Any) -> Any:
    """A real MoE GPTModel (config default: `tiny_moe_config()`); keywords as `build_tiny_gpt`."""
    config = config if config is not None else tiny_moe_config()
    if not getattr(config, "num_moe_experts", None):
        raise ValueError("build_tiny_moe_gpt needs a config with num_moe_experts set (see tiny_moe_config)")
    return build_tiny_gpt(config, layer_spec=moe_layer_spec(config.num_moe_experts), **kwargs)


def expert_index(name: str) -> int | None:
    """The local expert number in a parameter name (`...experts.local_experts.<i>.…`), else None."""
    marker = "local_experts."
    if marker not in name:
        return None
    return int(name.split(marker, 1)[1].split(".", 1)[0])


def global_expert_name(name: str, ep_rank: int, experts_per_rank: int) -> str:
    """A local expert parameter's name with its global expert number (`ep_rank * experts_per_rank
    + i`), as the model at expert-parallel size 1 names it; other names unchanged."""
    local = expert_index(name)
    if local is None:
        return name
    head, tail = name.split("local_experts.", 1)
    return f"{head}local_experts.{ep_rank * experts_per_rank + local}.{tail.split('.', 1)[1]}"
