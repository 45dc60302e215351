"""MoE layers (megatron-core's transformer layer whose MLP routes tokens): each token's routing is its
own, exact under a plan; what the router counts over the batch's tokens in training (the z-loss, the
load-balancing losses, the expert-bias counts, Sinkhorn's balancing) counts each sample's own rows
(`moe_statistics.prepare_moe_layer`: the router routes the logical rows, handed the plan by the
layer's call). What drops or pads tokens by the batch, or draws noise per forward, is refused by its
config field."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_rl_patches.shared_prefix.kinds.fields import UNTESTED, Known, Settings, checked, per_token, rows, zero
from megatron_rl_patches.shared_prefix.kinds.kind import ByCode, Continuation
from megatron_rl_patches.shared_prefix.moe_statistics import ROUTER_LOGITS, is_moe_layer, prepare_moe_layer

ROUTING = per_token("each token's own routing (MoE routing per token is exact: tested at EP = 1 and 2)")
WITHOUT_DROPPING = per_token("only with moe_expert_capacity_factor, which is refused")
READ_WITH = per_token("read by another field's check")
LOSSES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
STATISTICS_WHY = ("the router counts each shared token once per sample by routing the samples' own rows, which "
                  "a MoE layer recomputed alone (its router run outside the layer's call) does not allow; recompute "
                  "whole layers or none, or set the statistic's coefficient to 0")


def _kinds(value: Any) -> list:
    """A field given as one value or one per layer, as a list."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _no_moe(settings: Settings) -> bool:
    return not settings.get("num_moe_experts")


def _moe_training(exact: str, test: Callable[[Any, Settings], bool], what: str, why: str) -> Known:
    """A MoE statistic: inert without experts and in forward-only passes; in training `test`."""
    return checked(exact, lambda value, s, training: _no_moe(s) or not training or test(value, s), what=what, why=why)


def _moe(exact: str, test: Callable[[Any, Settings], bool], what: str, why: str) -> Known:
    return checked(exact, lambda value, s, training: _no_moe(s) or test(value, s), what=what, why=why)


def _split_rows(s: Settings) -> bool:
    """Sequence parallelism over more than one rank: each rank holds a share of the rows."""
    return bool(s.get("sequence_parallel")) and int(s.get("tensor_model_parallel_size") or 1) != 1


def _statistics(s: Settings) -> bool:
    """The router's statistics counted on each sample's own rows (shared_prefix/moe_statistics.py)."""
    recomputed = set(s.get("recompute_modules") or []) if s.get("recompute_granularity") == "selective" else set()
    return not recomputed & {"moe", "mlp"}


class MoeLayers(ByCode):
    def recognizes(self, module: Any) -> bool:
        return super().recognizes(module) and is_moe_layer(module)

    def prepare(self, module: Any) -> bool:
        prepare_moe_layer(module)
        return True


FIELDS = rows({  # routing is per token; statistics over the batch's tokens are not
    "num_moe_experts": ROUTING,
    "moe_expert_capacity_factor": _moe("None", lambda v, s: v is None, "MoE token dropping",
                                       "which tokens drop depends on the batch's tokens; set "
                                       "moe_expert_capacity_factor=None"),
    "moe_token_dropping": _moe("False", lambda v, s: not v, "MoE token dropping",
                               "which tokens drop depends on the batch's tokens"),
    "moe_router_load_balancing_type": _moe_training(
        f"{' or '.join(map(repr, LOSSES))} in training (their statistics as below; Sinkhorn without sequence "
        "or context parallelism); any in forward-only passes",
        lambda v, s: set(_kinds(v)) <= set(LOSSES) and not ("sinkhorn" in _kinds(v) and (
            _split_rows(s) or int(s.get("context_parallel_size") or 1) > 1)),
        "MoE quantile load balancing, or Sinkhorn's under sequence parallelism or context parallelism, in training",
        "quantile balancing keeps a running estimate over the batch's tokens the package has not shown exact; "
        "Sinkhorn balances each rank's share of the rows on its own, so under sequence or context parallelism the "
        "samples sharing a prefix token route it differently on different ranks, where the plan computes it once; "
        "use 'none' or an aux loss (Sinkhorn runs exact without sequence or context parallelism)"),
    "moe_aux_loss_coeff": _moe_training(
        "any in training where the router's statistics run on each sample's tokens (MoE not recomputed alone; "
        "tested at 1 rank, EP = 2, TP = 2 + SP with EP = 2)",
        lambda v, s: zero(v) or set(_kinds(s.get("moe_router_load_balancing_type"))) == {"none"} or _statistics(s),
        "MoE load balancing in training with the MoE layer recomputed alone",
        STATISTICS_WHY),
    "moe_z_loss_coeff": _moe_training("any in training where the router's statistics run on each sample's tokens",
                                      lambda v, s: zero(v) or _statistics(s),
                                      "MoE z-loss in training with the MoE layer recomputed alone",
                                      STATISTICS_WHY),
    "moe_router_enable_expert_bias": _moe_training(
        "False; True with moe_router_bias_update_rate 0; True with any rate where the router's statistics run on "
        "each sample's tokens",
        lambda v, s: not v or zero(s.get("moe_router_bias_update_rate")) or _statistics(s),
        "MoE expert bias updated in training with the MoE layer recomputed alone",
        STATISTICS_WHY),
    "moe_router_bias_update_rate": READ_WITH,
    "moe_router_force_load_balancing": _moe("False", lambda v, s: not v, "MoE forced load balancing",
                                            "it routes by the batch, not by each token; " + UNTESTED),
    "moe_input_jitter_eps": _moe_training("None or 0 in training", lambda v, s: zero(v), "MoE router input jitter",
                                          "a prefix's noise would be drawn once for every sample sharing it; set it "
                                          "to None"),
    "moe_router_force_biased": _moe("None", lambda v, s: v is None, "MoE random router bias",
                                    "it draws a bias per forward, not per token; " + UNTESTED),
    "moe_expert_rank_capacity_factor": _moe("None", lambda v, s: v is None, "MoE token dropping per expert rank",
                                            "which tokens drop depends on the batch's tokens; set it to None"),
    "moe_enable_routing_replay": _moe(
        "any at context parallelism 1 and one pipeline stage (the router routes the packed rows and replays their "
        "records; the plan built with routed_experts=, sharing only rows whose records agree: tested at 1 rank and "
        "TP = 2 + SP with EP = 2)",
        lambda v, s: not v or (int(s.get("context_parallel_size") or 1) == 1
                               and int(s.get("pipeline_model_parallel_size") or 1) == 1),
        "MoE routing replay beside context parallelism or pipeline stages",
        "each context-parallel rank replays its own cut of the packed rows, which the package has not yet routed "
        "under a plan, and each pipeline stage holds its own layers' records while every stage must build the same "
        "plan; set context_parallel_size=1 and pipeline_model_parallel_size=1, or pack the micro-batch whole"),
    "moe_router_padding_for_quantization": _moe("False", lambda v, s: not v, "MoE routing-map padding", UNTESTED),
    "moe_router_padding_for_fp8": _moe("False", lambda v, s: not v, "MoE routing-map padding", UNTESTED),
    "moe_pad_expert_input_to_capacity": WITHOUT_DROPPING,
    "moe_token_drop_policy": WITHOUT_DROPPING,
    "moe_router_quantile_balancing_ema": READ_WITH,
    "moe_per_layer_logging": per_token("logging only: the logged counts are of the tokens computed"),
}, {ROUTING: """moe_router_topk moe_router_score_function moe_router_pre_softmax moe_router_topk_scaling_factor
        moe_router_num_groups moe_router_group_topk moe_router_topk_limited_devices moe_router_dtype"""})
MOE_LAYERS = MoeLayers("MoE layer", classes=("megatron.core.transformer.transformer_layer:TransformerLayer",),
                       fields=FIELDS, continuation=Continuation(roles=(ROUTER_LOGITS,)))
