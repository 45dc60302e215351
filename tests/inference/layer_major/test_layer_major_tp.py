"""score_layer_major and the inference builds under tensor parallelism (TP=2, gloo), without and
with sequence parallelism, and on an MoE model at expert parallelism 2 (one spawn for the module):
on every rank the logits (shard) and the fused log-probs (vocab-parallel, one all-reduce per
statistic) equal the per-micro-batch forward's bit for bit, with a stream build copying each piece
of its shard once per rollout; the resident build's logits equal the trainable model's in eval, and
the swap and stream builds' the resident one's, bit for bit."""
from __future__ import annotations

import pytest

from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.multirank import run_multirank

pytestmark = [pytest.mark.megatron, pytest.mark.multirank, pytest.mark.slow]


def _layer_major_against_per_micro_batch(env, provider) -> dict:
    import torch

    from megatron_rl_patches import (
        build_inference_model,
        log_prob_output_processor,
        residency_report,
        score_layer_major,
    )

    resident = build_inference_model(provider)
    streamed = build_inference_model(provider, residency="stream")
    batches = []
    for seed, size in enumerate((2, 1)):
        batch = env.batch(batch_size=size, seed=seed)
        batches.append({"input_ids": batch["tokens"], "position_ids": batch["position_ids"],
                        "attention_mask": batch["attention_mask"], "labels": batch["labels"]})
    logits_batches = [{k: v for k, v in b.items() if k != "labels"} for b in batches]
    processor = log_prob_output_processor(with_entropy=True)
    with torch.no_grad():
        want_logits = [resident[0](**b) for b in logits_batches]
        want = [resident[0](**b, output_processor=processor) for b in batches]
    got_logits = score_layer_major(streamed, logits_batches)
    got = score_layer_major(streamed, batches, output_processor=processor)
    trainable = provider().eval()  # the same seed: the weights the inference builds hold
    with torch.no_grad():
        builds = {"trainable": [trainable(**b) for b in logits_batches],
                  **{mode: [build_inference_model(provider, residency=mode)[0](**b) for b in logits_batches]
                     for mode in ("swap", "stream")}}
    return {
        "builds": {mode: all(torch.equal(g, w) for g, w in zip(outs, want_logits)) for mode, outs in builds.items()},
        "vocab_shard": got_logits[0].shape[-1],
        "logits": all(torch.equal(g, w) for g, w in zip(got_logits, want_logits)),
        "log_probs": all(torch.equal(g[k], w[k]) for g, w in zip(got, want) for k in ("log_probs", "entropy")),
        "copies": residency_report(streamed).copies_by_unit,
    }


def _worker(rank: int, world_size: int) -> dict:
    import megatron_rl_patches
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu
    from megatron_rl_patches.testing.moe_gpt import build_tiny_moe_gpt, tiny_moe_config

    megatron_rl_patches.apply(only="gpt_output_processor")
    out = {}
    with megatron_on_cpu(tensor_parallel=world_size) as env:
        for label, sp in (("tp2", False), ("sp", True)):
            config = env.config(num_layers=2, tensor_model_parallel_size=world_size, sequence_parallel=sp)
            out[label] = _layer_major_against_per_micro_batch(env, env.model_provider(config, seed=17))
    with megatron_on_cpu(expert_parallel=world_size) as env:
        config = tiny_moe_config(expert_parallel=world_size)

        def moe_provider(pre_process=True, post_process=True, vp_stage=None):
            return build_tiny_moe_gpt(config, seed=17)

        out["ep2"] = _layer_major_against_per_micro_batch(env, moe_provider)
    return out


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_multirank(_worker, 2, timeout=300)


@layouts.mark("tp2")
def test_tp2_layer_major_equals_per_micro_batch_on_every_rank(world):
    for result in world:
        result = result["tp2"]
        assert result.pop("builds") == {"trainable": True, "swap": True, "stream": True}
        assert result["vocab_shard"] == 32  # vocab 64 over 2 ranks
        assert result["logits"] and result["log_probs"]
        assert result["copies"] == {"embedding": 2, "layer0": 2, "layer1": 2, "head": 2}  # two rollouts


@layouts.mark("tp2", "sp")
def test_sequence_parallel_layer_major_equals_per_micro_batch_on_every_rank(world):
    for result in world:
        result = result["sp"]
        assert result.pop("builds") == {"trainable": True, "swap": True, "stream": True}
        assert result["vocab_shard"] == 32
        assert result["logits"] and result["log_probs"]
        assert result["copies"] == {"embedding": 2, "layer0": 2, "layer1": 2, "head": 2}


@layouts.mark("moe", "ep2")
def test_ep2_moe_layer_major_equals_per_micro_batch_on_every_rank(world):
    for result in world:
        result = result["ep2"]
        assert result.pop("builds") == {"trainable": True, "swap": True, "stream": True}
        assert result["vocab_shard"] == 64  # no tensor parallelism: the whole vocabulary
        assert result["logits"] and result["log_probs"]
        assert set(result["copies"].values()) == {2}, result["copies"]
