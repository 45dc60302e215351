"""The slime lane's MoE student with slime's routing replay: slime 624b824a's Megatron patch
(`docker/patch/latest/megatron.patch`) wraps `compute_topk` inside megatron-core's
`topk_routing_with_score_function` with `slime.utils.routing_replay.get_routing_replay_compute_topk`
and calls `register_routing_replay(self)` at the end of `TopKRouter.__init__`. The lane's
megatron-core 0.16.1 wheel is unpatched, so `patch_router` installs the same two hunks at run time:
megatron-core's own `router_replay` hook (a `get_replay_topk(scores, topk, num_groups, group_topk,
compute_topk)` object, 0.16.1) receives slime's wrapper of that `compute_topk`."""
from __future__ import annotations

from typing import Any

MOE_ARGV = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "none",
            "--moe-aux-loss-coeff", "0", "--moe-ffn-hidden-size", "64", "--disable-bias-linear")
# slime's validate_args forces the alltoall dispatcher: kept (at expert-parallel size 1 its
# all-to-alls are identities, so gloo runs it)
MOE_VALUES: dict[str, Any] = {}


class SlimeComputeTopk:
    """megatron-core's `router_replay` object answering with slime's replaying `compute_topk`."""

    def get_replay_topk(self, scores: Any, topk: int, num_groups: Any, group_topk: Any, compute_topk: Any) -> Any:
        from slime.utils.routing_replay import get_routing_replay_compute_topk

        return get_routing_replay_compute_topk(compute_topk)(scores, topk, num_groups, group_topk)


def patch_router(monkeypatch: Any) -> None:
    """slime's two router hunks on the installed megatron-core (undone with `monkeypatch`)."""
    from megatron.core.transformer.moe import router
    from slime.utils.routing_replay import register_routing_replay

    topk_routing = router.topk_routing_with_score_function

    def routed(*args: Any, router_replay: Any = None, **kwargs: Any) -> Any:
        return topk_routing(*args, router_replay=router_replay or SlimeComputeTopk(), **kwargs)

    init = router.TopKRouter.__init__

    def registered(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        register_routing_replay(self)

    monkeypatch.setattr(router, "topk_routing_with_score_function", routed)
    monkeypatch.setattr(router.TopKRouter, "__init__", registered)


def provider_func(args: Any, role: str = "actor") -> Any:
    """slime's `get_model_provider_func` stand-in: the packed tiny GPT with 4 experts routed top-2."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_rl_patches.testing.moe_gpt import moe_layer_spec
    from megatron_rl_patches.testing.packed_gpt import packed_gpt_spec

    def provider(pre_process: bool = True, post_process: bool = True, vp_stage: Any = None, config: Any = None,
                 **_: Any) -> Any:
        import torch

        config = config if config is not None else core_transformer_config_from_args(args)
        spec = moe_layer_spec(config.num_moe_experts)
        attention = packed_gpt_spec().submodules.self_attention.submodules.core_attention
        spec.submodules.self_attention.submodules.core_attention = attention
        torch.manual_seed(0)
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                        max_sequence_length=args.max_position_embeddings, position_embedding_type="rope",
                        pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)

    return provider


def build(args: Any) -> tuple[list[Any], Any, Any]:
    """slime's own `setup_model_and_optimizer(args, "actor")` on the MoE student."""
    from unittest import mock

    from slime.backends.megatron_utils import model as slime_model

    with mock.patch.object(slime_model, "get_model_provider_func", provider_func):
        return slime_model.setup_model_and_optimizer(args, "actor")
