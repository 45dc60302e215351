"""Tensor parallelism (TP=2, gloo): each rank streams only its shard, and swap/stream outputs
equal the resident build's bit for bit on every rank."""
from __future__ import annotations

import pytest

from megatron_rl_patches.testing.multirank import run_multirank

pytestmark = [pytest.mark.megatron, pytest.mark.multirank, pytest.mark.slow]


def _tp_worker(rank: int, world_size: int) -> dict:
    import torch

    from megatron_rl_patches import build_inference_model, residency_report
    from megatron_rl_patches.inference.residency_storage import device_weight_bytes
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    with megatron_on_cpu(tensor_parallel=world_size) as env:
        def build(residency):
            provider = env.model_provider(env.config(num_layers=3, tensor_model_parallel_size=world_size), seed=7)
            return build_inference_model(provider, residency=residency)[0]

        reference = build("resident")
        batch = env.batch(seed=3)
        want = env.forward(reference, batch)
        shard = sum(p.numel() * p.element_size() for p in reference.parameters())
        result: dict = {"shard": shard, "vocab_shard": want.shape[-1]}
        for residency in ("swap", "stream"):
            chunk = build(residency)
            got = env.forward(chunk, batch)
            report = residency_report(chunk)
            result[residency] = {
                "equal": bool(torch.equal(got, want)),
                "after": device_weight_bytes(chunk.parameters()),
                "host": report.host_bytes,
                "moved": report.bytes_moved,
                "peak": report.peak_device_weight_bytes,
            }
        return result


def test_tp2_each_rank_streams_its_shard():
    results = run_multirank(_tp_worker, 2, timeout=300)
    for result in results:
        assert result["vocab_shard"] == 32  # vocab 64 split over 2 ranks: the logits are per-rank shards
        for residency in ("swap", "stream"):
            figures = result[residency]
            assert figures["equal"], residency
            assert figures["after"] == 0
            assert figures["host"] == figures["moved"] == result["shard"]  # the shard only, once
        assert result["stream"]["peak"] < result["swap"]["peak"] == result["shard"]
