"""A step's held segments at the layouts they claim, checked inside the multi-rank worlds of
tests/shared_prefix (test_layouts.py's 2 ranks): TP = 2 + SP, data parallelism through megatron-core's
schedule with DDP's overlapped reduce and the distributed optimizer (each rank its own cuts), CP = 2
(zigzag and contiguous ids), EP = 2 (each rank its own cuts, its side passes and recomputes agreed
over the expert-parallel group; MoE statistics). Each against the same micro-batches packed whole."""
from __future__ import annotations

from typing import Any

import torch

from kit.shared_prefix import objective, ordinary, scores, step_batches

TOL, GRAD_TOL = 1e-6, 2e-6


def draw(n: int, seed: int) -> list[int]:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def group_samples(width: int = 1) -> list[list[int]]:
    """A prompt with six responses and a sample alone, every length a multiple of `width`."""
    prompt = draw(40, 1)
    return [prompt + draw(n * width, 10 + i) for i, n in enumerate((1, 2, 3, 1, 2, 1))] + [draw(12, 99)]


CUTS = ([[0, 1], [2, 3, 6], [4, 5]], [[0, 1, 2], [3, 4, 5], [6]])  # rank 0's, rank 1's


def plan_step(batches: list, group: Any = None, **kwargs: Any) -> Any:
    from megatron_rl_patches.shared_prefix import plan_shared_prefix_step

    return plan_shared_prefix_step([(b.tokens, b.cu_seqlens) for b in batches], samples=[b.samples for b in batches],
                                   group=group, **kwargs)


def held_forward(model: Any, batch: Any, plan: Any, ids: Any = None, cp_layout: str = "zigzag") -> Any:
    from megatron_rl_patches.shared_prefix import shared_prefix_params

    return model(batch.tokens if ids is None else ids, None, None,
                 packed_seq_params=shared_prefix_params(plan, cp_layout=cp_layout))


def sum_sequence_parallel(model: Any, grads: dict, group: Any) -> dict:
    for name, param in model.named_parameters():  # each rank's share of the rows: summed as finalize_model_grads does
        if getattr(param, "sequence_parallel", False):
            torch.distributed.all_reduce(grads[name], group=group)
    return grads


def tensor_parallel_held() -> tuple:
    """TP = 2 + SP, a group over three micro-batches under a budget: (log-prob error, gradient error)."""
    from megatron.core import parallel_state

    from megatron_rl_patches.shared_prefix import prepare_shared_prefix
    from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu, tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    with megatron_on_cpu(tensor_parallel=2):
        tp = parallel_state.get_tensor_model_parallel_group()
        config = tiny_gpt_config(tensor_model_parallel_size=2, sequence_parallel=True, num_query_groups=2)
        model = prepare_shared_prefix(build_packed_gpt(seq_length=512, seed=4, config=config))
        batches = step_batches(group_samples(), CUTS[0], padding=2, multiple=2)
        step = plan_step(batches, pad_to=2, max_tokens=30)
        results = []
        for route in ([ordinary] * 3, [lambda m, b, p=p: held_forward(m, b, p) for p in step.plans]):
            scored = []
            for index, (batch, one) in enumerate(zip(batches, route)):
                log_probs, entropy = scores(one(model, batch), batch, tp)
                objective(log_probs, entropy, seed=index).backward()
                scored.append(log_probs.detach())
            results.append((scored, sum_sequence_parallel(model, collect_grads(model), tp)))
    (want, want_grads), (got, grads) = results
    return max(relative_error(g, w) for g, w in zip(got, want)), grad_error(grads, want_grads), bool(step.store.values)


def data_parallel_held() -> tuple:
    """DP = 2 through megatron-core's schedule (DDP: overlapped reduce, distributed optimizer), each
    rank its own cuts: (the largest error of the reduced gradient, the reduce's starts equal)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_rl_patches.shared_prefix import prepare_shared_prefix
    from megatron_rl_patches.testing.compare import relative_error
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu, tiny_gpt_config, wrap_ddp
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    rank = torch.distributed.get_rank()
    out = []
    with megatron_on_cpu():
        for held in (False, True):
            config = tiny_gpt_config(num_query_groups=2)
            ddp = wrap_ddp(build_packed_gpt(seq_length=512, seed=3, config=config), overlap_grad_reduce=True,
                           use_distributed_optimizer=True, bucket_size=2000)
            config.no_sync_func, config.finalize_model_grads_func = ddp.no_sync, None
            prepare_shared_prefix(ddp)
            batches = step_batches(group_samples(), CUTS[rank], padding=3)
            plans = plan_step(batches).plans if held else [None] * len(batches)

            def forward_step(iterator, model):
                batch, plan = next(iterator)
                output = ordinary(model, batch) if plan is None else held_forward(model, batch, plan)

                def loss(logits):
                    value = objective(*scores(logits, batch))
                    return value, {"objective": value.detach()}

                return output, loss

            get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(list(zip(batches, plans))),
                                        model=[ddp], num_microbatches=len(batches), seq_length=64,
                                        micro_batch_size=1, forward_only=False)
            ddp.finish_grad_sync()
            out.append([bucket.grad_data.clone() for buffer in ddp.buffers for bucket in buffer.buckets])
    return max(relative_error(g, w) for g, w in zip(out[1], out[0])),


def context_parallel_held(layout: str) -> tuple:
    """CP = 2 (each rank its `layout` share of each micro-batch's ids) against the same micro-batches
    packed whole at CP = 1, the same weights: (log-prob error, gradient error summed over the ranks)."""
    from megatron.core import parallel_state

    from kit.context_parallel_prefix import context_parallel_served, planned_with
    from megatron_rl_patches import log_probs_and_entropy
    from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error
    from megatron_rl_patches.testing.cp_layout import local_rows
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu, tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    if not context_parallel_served():
        return ()
    batches = step_batches(group_samples(width=4), CUTS[0], padding=4)
    with megatron_on_cpu():
        model = build_packed_gpt(seq_length=512, seed=4, config=tiny_gpt_config(num_query_groups=2))
        weights = {name: param.detach().clone() for name, param in model.named_parameters()}
        want = []
        for index, batch in enumerate(batches):
            log_probs, entropy = scores(ordinary(model, batch), batch)
            objective(log_probs, entropy, seed=index).backward()
            want.append(log_probs.detach())
        want_grads = collect_grads(model)
    with megatron_on_cpu(context_parallel=2):
        cp, rank = parallel_state.get_context_parallel_group(), parallel_state.get_context_parallel_rank()
        config = tiny_gpt_config(context_parallel_size=2, num_query_groups=2)
        model = planned_with(build_packed_gpt(seq_length=512, seed=4, context_parallel_layout="zigzag", config=config),
                             weights)
        step = plan_step(batches, pad_to=4, max_tokens=40)
        errors = []
        for index, (batch, plan) in enumerate(zip(batches, step.plans)):
            mine = local_rows(layout, rank, 2, cu_seqlens=batch.cu_seqlens)
            logits = held_forward(model, batch, plan, batch.tokens[:, mine], cp_layout=layout)
            sample = mine < batch.rows.numel()
            rows = mine[sample]
            log_probs, entropy = log_probs_and_entropy(logits[0, sample], batch.labels[0, rows], with_entropy=True)
            weights_of_rows = torch.randn(2, batch.rows.numel(), generator=torch.Generator().manual_seed(index))
            ((weights_of_rows[0, rows] * log_probs).sum() + (weights_of_rows[1, rows] * entropy).sum()).backward()
            errors.append(relative_error(log_probs.detach(), want[index][rows]))
        grads = collect_grads(model, summed_over=cp)
    return max(errors), grad_error(grads, want_grads), bool(step.store.values)


def expert_parallel_held() -> tuple:
    """EP = 2 (4 experts, 2 a rank, the allgather dispatcher), each rank its own cuts (other side passes
    and recomputes: agreed over the expert-parallel group), an aux loss, a z-loss and expert-bias
    counts: (log-prob error, gradient error, largest logged-loss error, counts equal, bias equal)."""
    from megatron.core import parallel_state

    from kit.moe_statistics import STATISTICS, read_statistics, reset_statistics
    from megatron_rl_patches.shared_prefix import prepare_shared_prefix
    from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu
    from megatron_rl_patches.testing.moe_gpt import tiny_moe_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    statistics = {**STATISTICS["aux-loss"], **STATISTICS["z-loss"], **STATISTICS["expert-bias"]}
    rank = torch.distributed.get_rank()
    with megatron_on_cpu(expert_parallel=2):
        model = prepare_shared_prefix(build_packed_gpt(seq_length=512, seed=9,
                                                       config=tiny_moe_config(expert_parallel=2, **statistics)))
        samples = group_samples()
        # each rank its own cuts, every micro-batch as many rows as the other rank's (the allgather dispatcher
        # gathers equal shares: the packed path too)
        longest = [max(sum(len(samples[i]) for i in cuts[m]) for cuts in CUTS) for m in range(3)]
        batches = [step_batches(samples, [cut], padding=longest[m] - sum(len(samples[i]) for i in cut), seed=m,
                                pad_id=7)[0] for m, cut in enumerate(CUTS[rank])]
        step = plan_step(batches, group=parallel_state.get_expert_model_parallel_group(), max_tokens=24)
        results = []
        for route in ([ordinary] * 3, [lambda m, b, p=p: held_forward(m, b, p) for p in step.plans]):
            before = reset_statistics(model)
            model.train()
            scored = []
            for index, (batch, one) in enumerate(zip(batches, route)):
                log_probs, entropy = scores(one(model, batch), batch)
                objective(log_probs, entropy, seed=index).backward()
                scored.append(log_probs.detach())
            results.append((scored, collect_grads(model), read_statistics(model, before)))
    (want, want_grads, want_stats), (got, grads, stats) = results
    losses = max(relative_error(stats["losses"][name], values) for name, values in want_stats["losses"].items())
    return (max(relative_error(g, w) for g, w in zip(got, want)), grad_error(grads, want_grads), losses,
            bool(stats["counts"]) and all(torch.equal(g, w) for g, w in zip(stats["counts"], want_stats["counts"])),
            bool(stats["bias"]) and all(torch.equal(g, w) for g, w in zip(stats["bias"], want_stats["bias"])),
            [len(p.held.side) for p in step.plans], [len(p.held.owned) for p in step.plans])


def held_checks() -> dict:
    return {"tp2-sp": tensor_parallel_held(), "dp2": data_parallel_held(),
            "cp2-zigzag": context_parallel_held("zigzag"), "cp2-contiguous": context_parallel_held("contiguous"),
            "ep2": expert_parallel_held()}
