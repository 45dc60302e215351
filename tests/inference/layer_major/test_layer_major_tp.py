"""score_layer_major under tensor parallelism (TP=2, gloo): on every rank the logits shard and the
fused log-probs (vocab-parallel, one all-reduce per statistic) equal the per-micro-batch forward's
bit for bit, with a stream build copying each piece of its shard once per rollout."""
from __future__ import annotations

import pytest

from megatron_rl_patches.testing.multirank import run_multirank

pytestmark = [pytest.mark.megatron, pytest.mark.multirank, pytest.mark.slow]


def _tp_worker(rank: int, world_size: int) -> dict:
    import torch

    import megatron_rl_patches
    from megatron_rl_patches import (
        build_inference_model,
        log_prob_output_processor,
        residency_report,
        score_layer_major,
    )
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    megatron_rl_patches.apply(only="gpt_output_processor")
    with megatron_on_cpu(tensor_parallel=world_size) as env:
        provider = env.model_provider(env.config(num_layers=2, tensor_model_parallel_size=world_size), seed=17)
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
        return {
            "vocab_shard": got_logits[0].shape[-1],
            "logits": all(torch.equal(g, w) for g, w in zip(got_logits, want_logits)),
            "log_probs": all(torch.equal(g[k], w[k]) for g, w in zip(got, want) for k in ("log_probs", "entropy")),
            "copies": residency_report(streamed).copies_by_unit,
        }


def test_tp2_layer_major_equals_per_micro_batch_on_every_rank():
    for result in run_multirank(_tp_worker, 2, timeout=300):
        assert result["vocab_shard"] == 32  # vocab 64 over 2 ranks
        assert result["logits"] and result["log_probs"]
        assert result["copies"] == {"embedding": 2, "layer0": 2, "layer1": 2, "head": 2}  # two rollouts
