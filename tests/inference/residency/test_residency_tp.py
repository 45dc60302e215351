"""Tensor parallelism (TP=2, gloo): each rank streams only its shard, and swap/stream outputs
equal the resident build's bit for bit on every rank; between forwards each rank's parameters are
its shard's real values (a state dict saved from a swap/stream teacher loads into a resident
build bit for bit), a forward inside the forward works, and an input requiring grad is refused
on every rank before any collective."""
from __future__ import annotations

import pytest

from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.multirank import run_multirank

pytestmark = [pytest.mark.megatron, pytest.mark.multirank, pytest.mark.slow, layouts.mark("tp2")]


def _tp_worker(rank: int, world_size: int, tmp: str) -> dict:
    import torch

    from megatron_rl_patches import build_inference_model, residency_report
    from megatron_rl_patches.inference.residency.storage import device_weight_bytes
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
                **_user_code(env, chunk, reference, batch, want, f"{tmp}/{residency}{rank}.pt", build),
            }
        return result


def _user_code(env, chunk, reference, batch, want, path, build) -> dict:
    import torch

    sums = all(torch.equal(p.sum(), q.sum()) for p, q in zip(chunk.parameters(), reference.parameters()))
    torch.save(chunk.state_dict(), path)
    resident = build("resident")
    resident.load_state_dict(torch.load(path, weights_only=True))
    loaded = all(torch.equal(p, q) for p, q in zip(resident.parameters(), reference.parameters()))
    inner: list = []

    def score_inside(module, args):
        if not inner:
            inner.append(None)
            inner.append(env.forward(chunk, batch))

    handle = chunk.decoder.layers[1].self_attention.register_forward_pre_hook(score_inside)
    with torch.no_grad():
        outer = env.forward(chunk, batch)
    handle.remove()
    hidden = torch.zeros(16, 2, 32, requires_grad=True)
    try:
        chunk(batch["tokens"], batch["position_ids"], batch["attention_mask"], decoder_input=hidden)
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return {"sums": sums, "checkpoint": loaded and bool(torch.equal(env.forward(resident, batch), want)),
            "reentrant": bool(torch.equal(outer, want) and torch.equal(inner[1], want)), "refused": refused}


def test_tp2_each_rank_streams_its_shard(tmp_path):
    results = run_multirank(_tp_worker, 2, str(tmp_path), timeout=300)
    for result in results:
        assert result["vocab_shard"] == 32  # vocab 64 split over 2 ranks: the logits are per-rank shards
        for residency in ("swap", "stream"):
            figures = result[residency]
            assert figures["equal"], residency
            assert figures["after"] == 0
            assert figures["host"] == figures["moved"] == result["shard"]  # the shard only, once
            assert figures["sums"] and figures["checkpoint"] and figures["reentrant"], residency
            assert f"requires grad, but residency='{residency}'" in figures["refused"]
        assert result["stream"]["peak"] < result["swap"]["peak"] == result["shard"]
