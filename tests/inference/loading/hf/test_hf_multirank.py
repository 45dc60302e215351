"""Hugging Face teachers at TP=2 (Qwen3, Qwen2's biases, Qwen3-MoE's experts),
PP=2 and EP=2 (one spawned 2-rank gloo world, several worlds of
parallel state in turn): log-probs of the logits route and the fused processor equal transformers'
forward to 1e-5 on the ranks that hold them; sizes that do not divide the model are refused."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.testing.multirank import run_multirank

pytestmark = [pytest.mark.megatron, pytest.mark.multirank, pytest.mark.slow]

VOCAB, SEQ = 1001, 12


def _scores(chunks, batch, tp_group):
    """{"logits": [b, s], "fused": [b, s]} through megatron-core's forward-only schedule (empty
    off the last pipeline stage)."""
    from megatron_rl_patches import log_prob_output_processor
    from megatron_rl_patches.inference import inference_forward, token_log_probs

    args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])

    def logits_step(iterator, model):
        next(iterator)
        return model(*args), batch["labels"]

    def fused_step(iterator, model):
        next(iterator)
        out = model(*args, labels=batch["labels"], output_processor=log_prob_output_processor(vocab_size=VOCAB))
        return out["log_probs"] if isinstance(out, dict) else out  # the schedule's MoE path needs a tensor

    options = dict(num_microbatches=1, seq_length=SEQ, micro_batch_size=2)
    routed = inference_forward(chunks, iter([None]), logits_step,
                               collect=token_log_probs(tp_group=tp_group, vocab_size=VOCAB), **options)
    fused = inference_forward(chunks, iter([None]), fused_step, collect=lambda out, _: out, **options)
    if not routed:
        return {}
    return {"logits": routed[0]["log_probs"].double(), "fused": fused[0].double()}


def _worker(rank: int, world_size: int, dense: str, moe: str, qwen2: str, batch: dict) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe import moe_utils

    from megatron_rl_patches import apply, build_inference_model_from_hf
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    if not hasattr(moe_utils, "te_general_gemm"):  # megatron-core < 0.17 without TE: see conftest
        moe_utils.te_general_gemm = None
    apply(only="gpt_output_processor")
    results: dict = {}
    with megatron_on_cpu(tensor_parallel=2):
        chunks = build_inference_model_from_hf(dense, dtype=torch.float32)
        results["tp2_vocab_shard"] = chunks[0].output_layer.weight.shape[0]
        results["tp2"] = _scores(chunks, batch, ps.get_tensor_model_parallel_group())
        results["tp2_stream"] = _scores(build_inference_model_from_hf(dense, residency="stream", dtype=torch.float32),
                                        batch, ps.get_tensor_model_parallel_group())
        # q/k/v biases split with their heads; experts split over the expert tensor-parallel group
        results["tp2_qwen2"] = _scores(build_inference_model_from_hf(qwen2, dtype=torch.float32), batch,
                                       ps.get_tensor_model_parallel_group())
        results["tp2_moe"] = _scores(build_inference_model_from_hf(moe, dtype=torch.float32), batch,
                                     ps.get_tensor_model_parallel_group())
    with megatron_on_cpu(pipeline_parallel=2):
        chunks = build_inference_model_from_hf(dense, dtype=torch.float32)
        results["pp2_layers"] = len(chunks[0].decoder.layers)
        results["pp2"] = _scores(chunks, batch, None)
    with megatron_on_cpu():
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
        chunks = build_inference_model_from_hf(moe, dtype=torch.float32)
        results["ep2_experts"] = len(chunks[0].decoder.layers[0].mlp.experts.local_experts)
        results["ep2"] = _scores(chunks, batch, None)
    with megatron_on_cpu(pipeline_parallel=2):
        try:
            build_inference_model_from_hf(dense + "_3layers")
            results["refused"] = None
        except ValueError as exc:
            results["refused"] = str(exc)
    return results


@pytest.fixture(scope="module")
def world(transformers, tmp_path_factory):
    from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf, tiny_hf_config, write_tiny_checkpoint
    from megatron_rl_patches.testing.megatron_cpu import make_batch

    root = tmp_path_factory.mktemp("hf")
    dense = save_tiny_hf(root / "dense", "qwen3", seed=7)
    moe = save_tiny_hf(root / "moe", "qwen3_moe", seed=8)
    qwen2 = save_tiny_hf(root / "qwen2", "qwen2", seed=9)
    write_tiny_checkpoint(root / "dense_3layers", tiny_hf_config("qwen3", num_hidden_layers=3))
    batch = make_batch(batch_size=2, seq_length=SEQ, vocab_size=VOCAB, seed=4)
    reference = {}
    for name, model in (("dense", dense), ("moe", moe), ("qwen2", qwen2)):
        with torch.no_grad():
            full = torch.log_softmax(model(batch["tokens"]).logits.double(), dim=-1)
        reference[name] = full.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
    results = run_multirank(_worker, 2, str(root / "dense"), str(root / "moe"), str(root / "qwen2"), batch, timeout=600)
    return results, reference


def _close(scores, want):
    return {route: (got - want).abs().max().item() for route, got in scores.items()}


def test_tp2_equals_transformers_on_every_rank(world):
    results, reference = world
    for result in results:
        assert result["tp2_vocab_shard"] == 512  # 1001 ids padded to 1024, half per rank
        for key in ("tp2", "tp2_stream"):
            assert set(result[key]) == {"logits", "fused"}
            assert all(err < 1e-5 for err in _close(result[key], reference["dense"]).values()), key


def test_tp2_qwen2_biases_and_moe_experts_equal_transformers(world):
    results, reference = world
    for result in results:
        for key, model in (("tp2_qwen2", "qwen2"), ("tp2_moe", "moe")):
            errors = _close(result[key], reference[model])
            assert set(errors) == {"logits", "fused"} and all(err < 1e-5 for err in errors.values()), (key, errors)


def test_pp2_equals_transformers_on_the_last_stage(world):
    results, reference = world
    assert [r["pp2_layers"] for r in results] == [1, 1]
    assert results[0]["pp2"] == {}
    errors = _close(results[1]["pp2"], reference["dense"])
    assert set(errors) == {"logits", "fused"} and all(err < 1e-5 for err in errors.values()), errors


def test_ep2_moe_equals_transformers(world):
    results, reference = world
    assert [r["ep2_experts"] for r in results] == [2, 2]  # 4 experts, 2 per rank
    for result in results:
        errors = _close(result["ep2"], reference["moe"])
        assert set(errors) == {"logits", "fused"} and all(err < 1e-5 for err in errors.values()), errors


def test_sizes_that_do_not_divide_the_model_are_refused(world):
    results, _ = world
    for result in results:
        assert "num_hidden_layers=3 is not a multiple of the pipeline-parallel size 2" in result["refused"]
