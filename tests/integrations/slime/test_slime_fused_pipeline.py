"""`slime_fused` at pipeline parallelism 2 (issue 40): 2 gloo ranks, a real GPTModel split in two
stages, thd-packed micro-batches as slime's get_batch builds them, megatron-core's pipeline
schedule. Stage 0's chunk must get the plain call (before the fix it wrapped its hidden states in
FusedOutput and failed, and stage 1 then waited for them); stage 1's fused log-probs equal the
log-probs of the same pipeline's logits (float64). slime's row helpers are replaced by the
identity layout here (one rank of context parallelism); the slime lane runs slime's own."""
from __future__ import annotations

import pytest

from megatron_rl_patches.testing import layouts

pytestmark = [pytest.mark.megatron, pytest.mark.multirank, pytest.mark.slow, layouts.mark("pp2", "thd")]

LENGTHS = (5, 7)  # two packed sequences in one micro-batch


def _stages(rank: int, world_size: int) -> dict:
    import types

    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.packed_seq_params import PackedSeqParams

    import megatron_rl_patches
    from megatron_rl_patches.integrations.slime import fused, rows
    from megatron_rl_patches.testing.megatron_cpu import megatron_world, run_schedule, tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import packed_gpt_spec

    length = sum(LENGTHS)
    tokens = torch.randint(0, 64, (1, length), generator=torch.Generator().manual_seed(5))
    targets = torch.roll(tokens[0], -1)  # the rows' next tokens, as slime's _build_shifted_tokens at CP 1
    rows.shifted_targets = lambda batch, n, device, allgather_cp: targets
    rows.response_rows = lambda batch, n, device, allgather_cp: torch.ones(n, dtype=torch.bool)
    megatron_rl_patches.apply(only="gpt_output_processor")  # megatron-core < 0.18, as the slime lane
    with megatron_world("cpu", pipeline_parallel=2):
        torch.manual_seed(11 + rank)
        config = tiny_gpt_config(num_layers=4, pipeline_model_parallel_size=2)
        stage = GPTModel(config=config, transformer_layer_spec=packed_gpt_spec(), vocab_size=64,
                         max_sequence_length=length, position_embedding_type="rope",
                         pre_process=parallel_state.is_pipeline_first_stage(),
                         post_process=parallel_state.is_pipeline_last_stage())
        cu = torch.tensor([0, LENGTHS[0], length], dtype=torch.int32)
        batch = {"tokens": tokens, "position_ids": torch.cat([torch.arange(n) for n in LENGTHS])[None],
                 "packed": PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                           max_seqlen_q=max(LENGTHS), max_seqlen_kv=max(LENGTHS))}
        plan = fused.FusedStep(types.SimpleNamespace(rollout_temperature=1.0), False, False, batch={"tokens": None})
        seen: dict = {}

        def step(data_iterator, model, route):
            micro = next(data_iterator)
            call = fused.FusedModel(model, plan) if route == "fused" else model
            out = call(input_ids=micro["tokens"], position_ids=micro["position_ids"], attention_mask=None,
                       packed_seq_params=micro["packed"])
            seen.setdefault(route, type(out).__name__)

            def loss(output):
                if isinstance(output, dict):
                    log_probs = output["log_probs"].reshape(-1).double()
                else:  # the logits, [1, T, V]
                    log_probs = torch.log_softmax(output.reshape(length, -1).double(), -1).gather(
                        -1, targets[:, None]).squeeze(-1)
                return log_probs.sum().float(), {"log_probs": log_probs.detach()}

            return out, loss

        results = {}
        for route in ("plain", "fused"):
            with torch.no_grad():
                stored = run_schedule([stage], [batch], forward_step=lambda it, m, r=route: step(it, m, r),
                                      forward_only=True)
            results[route] = [entry["log_probs"] for entry in stored] if stored else None
    return {"seen": seen, **results}


def test_two_pipeline_stages_run_the_fused_route():
    import torch

    from megatron_rl_patches.testing.multirank import run_multirank

    first, last = run_multirank(_stages, 2, timeout=240)
    assert first["seen"] == {"plain": "Tensor", "fused": "Tensor"}  # stage 0: hidden states, the plain call
    assert first["plain"] is None and first["fused"] is None  # no loss on a non-last stage
    assert last["seen"] == {"plain": "Tensor", "fused": "FusedOutput"}
    (plain,), (fused_log_probs,) = last["plain"], last["fused"]
    assert plain.shape == (sum(LENGTHS),)
    torch.testing.assert_close(fused_log_probs, plain, rtol=0, atol=2e-6)
