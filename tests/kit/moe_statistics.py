"""An MoE model's routing statistics in one training pass, as a test compares them between the
ordinary packed path and a shared-prefix plan: the load-balancing and z-losses megatron-core
logs per layer, each router's expert-bias token counts, and the expert bias after megatron's own
update (`finalize_model_grads`' step), besides log-probs and every gradient."""
from __future__ import annotations

from typing import Any

import torch

from kit.shared_prefix import PackedBatch, grpo_batch, objective, scores

# every statistic megatron-core's top-k router counts in training, each on its own
STATISTICS = {
    "aux-loss": dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1),
    "seq-aux-loss": dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.1),
    "global-aux-loss": dict(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.1),
    "z-loss": dict(moe_z_loss_coeff=0.01),
    "expert-bias": dict(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.01,
                        moe_router_score_function="sigmoid"),
    "sinkhorn": dict(moe_router_load_balancing_type="sinkhorn", moe_router_topk=1),
}


def constant_padding(groups: tuple, alone: tuple, padding: int, seed: int = 0) -> PackedBatch:
    """`grpo_batch` whose padding rows are one repeated id, as frameworks pad (slime pads with one id):
    the plan computes one padding row for all of them, and one id's rows are alike at every layer."""
    batch = grpo_batch(groups, alone, padding=0, seed=seed)
    pad = torch.full((1, padding), 7, dtype=batch.tokens.dtype)
    tokens = torch.cat([batch.tokens, pad], dim=1)
    labels = torch.cat([batch.labels[:, :-1], pad[:, :1], pad], dim=1) if padding else batch.labels
    cu = torch.cat([batch.cu_seqlens, batch.cu_seqlens[-1:] + padding]) if padding else batch.cu_seqlens
    positions = torch.cat([batch.positions, torch.arange(padding)[None]], dim=1)
    return PackedBatch(tokens=tokens, labels=labels, positions=positions, cu_seqlens=cu, samples=batch.samples,
                       sequences=batch.sequences, rows=batch.rows)


def varying_padding(groups: tuple, alone: tuple, paddings: tuple = (5, 4), seed: int = 0) -> PackedBatch:
    """`grpo_batch` whose padding is several sequences of varying ids (`paddings`: their lengths), each
    its own sequence in `cu_seqlens` at positions from 0: megatron-core's packed path computes each
    row by its own id, and its MoE statistics and MTP loss count every one."""
    batch = grpo_batch(groups, alone, padding=sum(paddings), seed=seed)
    samples_end = int(batch.cu_seqlens[batch.samples])
    cu = batch.cu_seqlens[:batch.samples + 1].tolist()
    for length in paddings:
        cu.append(cu[-1] + length)
    positions = torch.cat([batch.positions[:, :samples_end], *(torch.arange(n)[None] for n in paddings)], dim=1)
    assert batch.tokens[0, samples_end:].unique().numel() > 1  # varying ids
    return PackedBatch(tokens=batch.tokens, labels=batch.labels, positions=positions,
                       cu_seqlens=torch.tensor(cu, dtype=torch.int32), samples=batch.samples,
                       sequences=batch.sequences, rows=batch.rows)


def routers(model: Any) -> list[Any]:
    return [m for m in model.modules() if hasattr(m, "routing") and hasattr(m, "topk")]


def logged_losses() -> dict:
    """megatron-core's per-layer MoE loss tracker ({name: entry}, the entry's per-layer `values` a key of
    a dict, or an attribute from 0.19 on)."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "get_moe_metrics_tracker"):  # 0.19
        return moe_utils.get_moe_metrics_tracker().metrics
    return moe_utils.get_moe_layer_wise_logging_tracker()


def reset_statistics(model: Any) -> list[torch.Tensor]:
    """Empty the logged MoE losses (sized by the first model's layers: made again per pass), the
    global aux-loss trackers and the token counts; returns the expert biases as they are (what
    `read_statistics` restores after reading the update)."""
    logged_losses().clear()
    bias_before = []
    for router in routers(model):
        if hasattr(router, "reset_global_aux_loss_tracker"):  # megatron-core >= 0.14 (global_aux_loss)
            router.reset_global_aux_loss_tracker()
        if router.local_tokens_per_expert is not None:
            router.local_tokens_per_expert.zero_()
            bias_before.append(router.expert_bias.clone())
    return bias_before


def read_statistics(model: Any, bias_before: list[torch.Tensor]) -> dict[str, Any]:
    """The logged MoE losses per layer, each router's token counts and its bias after megatron's
    update (`finalize_model_grads`' step), the bias then put back."""
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias

    losses = {name: (entry["values"] if isinstance(entry, dict) else entry.values).clone()
              for name, entry in logged_losses().items()}
    biased = [r for r in routers(model) if r.local_tokens_per_expert is not None]
    counts = [r.local_tokens_per_expert.clone() for r in biased]
    bias = []
    if counts:
        _update_router_expert_bias([model], model.config)  # finalize_model_grads' step: counts -> bias
        bias = [r.expert_bias.clone() for r in biased]
        for router, before in zip(biased, bias_before):
            router.expert_bias.copy_(before)  # the next pass starts from the same bias
    return {"losses": losses, "counts": counts, "bias": bias}


def statistics_pass(model: Any, batch: PackedBatch, route: Any, tp_group: Any = None) -> dict[str, Any]:
    """One training pass of `batch` by `route` (the kit's `ordinary` or `planned`): log-probs,
    gradients, the logged MoE losses per layer, the token counts and the bias after the update
    (`tp_group`: the vocabulary split over it)."""
    from megatron_rl_patches.testing.compare import collect_grads

    bias_before = reset_statistics(model)
    model.train()
    log_probs, entropy = scores(route(model, batch), batch, tp_group)
    objective(log_probs, entropy).backward()
    return {"log_probs": log_probs.detach(), "grads": collect_grads(model), **read_statistics(model, bias_before)}
