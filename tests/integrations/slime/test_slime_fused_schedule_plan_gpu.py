"""`make test-gpu` (2 CUDA devices, megatron-core >= 0.18; skipped elsewhere): the full combined-1F1B
plan on `slime_fused`. An EP=2 MoE GPT (alltoall dispatcher, bf16, `overlap_moe_expert_parallel_comm`)
runs two micro-batches of packed thd input through megatron's own schedule, once with the overlap
(megatron's combined-1F1B schedule asks slime's forward step for `model.build_schedule_plan`, which
`slime_fused` gives the processor) and once without (the fused model call): the same log-probs and
gradients; the CPU lane shows the plan built and its nodes run (test_slime_fused_schedule_plan.py)."""
from __future__ import annotations

import inspect
import os
import socket
import types

import pytest
import torch

pytestmark = pytest.mark.gpu
LENGTHS = ((5, 7), (6, 6))  # two micro-batches of two packed sequences
V = 100


def _plan_takes_processor() -> bool:
    try:
        from megatron.core.models.gpt.gpt_model import GPTModel
    except ImportError:
        return False
    build = getattr(GPTModel, "build_schedule_plan", None)
    return build is not None and "output_processor" in inspect.signature(build).parameters


def _model(rank: int):
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_rl_patches.testing.moe_gpt import moe_layer_spec, tiny_moe_config
    from megatron_rl_patches.testing.packed_gpt import packed_gpt_spec

    config = tiny_moe_config(expert_parallel=2, moe_token_dispatcher_type="alltoall", bf16=True,
                             params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
                             overlap_moe_expert_parallel_comm=True)
    spec = moe_layer_spec(config.num_moe_experts)
    spec.submodules.self_attention.submodules.core_attention = (
        packed_gpt_spec().submodules.self_attention.submodules.core_attention)  # packed thd on any device
    torch.manual_seed(7 + rank)  # each EP rank's experts differ; the dense weights are seeded alike below
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=V, max_sequence_length=32,
                     position_embedding_type="rope").cuda()
    torch.manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" not in name:
                p.copy_(torch.randn_like(p, dtype=torch.float32).to(p.dtype) * 0.05)
    return model


def _batches() -> list[dict]:
    from megatron_rl_patches.testing.packed_gpt import make_packed_batch

    out = []
    for i, lengths in enumerate(LENGTHS):
        batch = make_packed_batch(list(lengths), vocab_size=V, seed=11 + i)
        out.append({k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
        params = batch["packed_seq_params"]
        for field in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            if getattr(params, field, None) is not None:
                setattr(params, field, getattr(params, field).cuda())
    return out


def _step(model, batches: list[dict], overlap: bool) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Two micro-batches through megatron's schedule with slime's forward-step shape on slime_fused."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_rl_patches.integrations.slime import fused as slime_fused

    model.config.overlap_moe_expert_parallel_comm = overlap
    model.zero_grad()
    log_probs: list[torch.Tensor] = []
    args = types.SimpleNamespace(rollout_temperature=1.0, log_probs_chunk_size=-1, allgather_cp=False)

    def forward_step(data_iterator, chunk, return_schedule_plan=False):
        batch = next(data_iterator)
        plan = slime_fused.FusedStep(args, False, False, batch=batch)
        call = dict(input_ids=batch["tokens"], position_ids=None, attention_mask=None, labels=None,
                    packed_seq_params=batch["packed_seq_params"], loss_mask=None)

        def loss_func(output):
            log_probs.append(output["log_probs"].detach().float().cpu())
            loss = -output["log_probs"].float().mean()
            return loss, {"loss": loss.detach()}

        def step(it, model, **kw):
            return (model.build_schedule_plan(**call) if kw.get("return_schedule_plan") else model(**call)), loss_func

        return slime_fused.fused_step(step, plan)(data_iterator, chunk, return_schedule_plan=return_schedule_plan)

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
                                num_microbatches=len(batches), seq_length=32, micro_batch_size=1, forward_only=False)
    torch.cuda.synchronize()
    return log_probs, {name: p.grad.float().cpu().clone() for name, p in model.named_parameters()
                       if p.grad is not None}


def _rank(rank: int, world_size: int, port: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_rl_patches.integrations.slime import rows

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world_size)
    model_parallel_cuda_manual_seed(1234)
    # slime's row helpers (the slime lane runs slime's own): the packed labels, every row a response row
    rows.shifted_targets = lambda batch, n, device, ag: batch["labels"][0]
    rows.response_rows = lambda batch, n, device, ag: torch.ones(n, dtype=torch.bool, device=device)
    try:
        model, batches = _model(rank), _batches()
        want_lp, want_grads = _step(model, batches, overlap=False)
        got_lp, got_grads = _step(model, batches, overlap=True)
        assert len(got_lp) == len(want_lp) == len(batches)
        for got, want in zip(got_lp, want_lp):
            torch.testing.assert_close(got, want, rtol=0, atol=2e-2)  # bf16
        assert got_grads.keys() == want_grads.keys() and want_grads
        for name, want in want_grads.items():
            scale = max(1.0, want.abs().max().item())
            assert (got_grads[name] - want).abs().max().item() <= 2e-2 * scale, name
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason=f"needs 2 CUDA devices, {torch.cuda.device_count()} here (expert parallelism 2 with "
                           "the alltoall dispatcher)")
def test_full_combined_1f1b_plan_equals_the_fused_model_call():
    if not _plan_takes_processor():
        pytest.skip("megatron-core < 0.18: build_schedule_plan has no output_processor (slime_fused falls back)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.multiprocessing.spawn(_rank, args=(2, port), nprocs=2, join=True)
