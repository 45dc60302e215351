"""MTP beside context parallelism under a sharing plan, checked in the 4-rank world of
tests/shared_prefix/test_context_parallel_layouts.py: a GPTModel with a 2-deep MTP block at CP = 2
(each rank its zigzag or contiguous share of the ids and labels) against the same samples packed
whole at CP = 1 with the same weights. megatron-core divides each rank's MTP loss by the rank's own
masked tokens, so both runs sum per token (`calculate_per_token_loss`): the ranks' losses and
gradients then add up to the whole ones."""
from __future__ import annotations

TOL, GRAD_TOL = 1e-6, 2e-6
DEPTH = 2


def mtp_batches():
    """Micro-batches as megatron-core's zigzag takes them (every sequence a multiple of 2 * CP rows),
    padded with one id as slime pads: the MTP loss counts the padding rows (megatron-core's loss mask
    is all ones where none is given), and the plan computes one padding row for all of them."""
    from kit.moe_statistics import constant_padding

    return [constant_padding(((60, (4, 8, 12, 4)),), (8,), padding=4),
            constant_padding(((33, (3, 7)), (21, (3, 7, 11))), (), padding=8, seed=1)]


def masked_tokens(batch, depth: int, rows):
    """How many of `rows` (logical rows of `batch`) megatron-core's loss mask keeps at MTP depth
    `depth` (all ones rolled `depth` times per sequence, the padding one sequence of its own)."""
    import torch

    bounds = batch.cu_seqlens.to(torch.int64)
    ends = torch.repeat_interleave(bounds[1:], bounds.diff())
    return int((rows + depth < ends[rows]).sum())


def mtp_beside_context_parallelism(runs) -> dict:
    """Per (layout, batch index) of `runs`: (main per-token loss error at this rank's sample rows, the
    error of each depth's MTP loss (the ranks' sums against the whole), the gradient error (summed over
    the CP ranks), this rank's rows each depth's layer ran, the rows its share of each depth's stream
    holds (counted independently of the plan), this rank's sample rows). Empty where megatron-core
    does not cut a plan over CP ranks or its MTP refuses packed input."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from kit.context_parallel_prefix import context_parallel_served, planned_with
    from kit.mtp_gpt import build_mtp_gpt, distinct_mtp_rows, layer_rows, mtp_pass, mtp_takes_packed_input
    from kit.shared_prefix import ordinary
    from megatron_rl_patches.shared_prefix import shared_prefix_params
    from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error
    from megatron_rl_patches.testing.cp_attention import cp_layer_spec
    from megatron_rl_patches.testing.cp_layout import local_rows
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu, tiny_gpt_config

    if not context_parallel_served() or not mtp_takes_packed_input():
        return {}
    batches = mtp_batches()

    def config(cp: int):
        return tiny_gpt_config(mtp_num_layers=DEPTH, num_query_groups=2, calculate_per_token_loss=True,
                               context_parallel_size=cp)

    want = {}
    with megatron_on_cpu():
        model = build_mtp_gpt(config(1))
        weights = {name: param.detach().clone() for name, param in model.named_parameters()}
        for index in sorted({index for _, index in runs}):
            batch = batches[index]
            whole = mtp_pass(model, batch, ordinary)
            everything = torch.arange(batch.tokens.size(1))
            whole["mtp"] = [float(whole["mtp"][d]) * masked_tokens(batch, d + 1, everything) for d in range(DEPTH)]
            want[index] = whole
            model.zero_grad()
    out = {}
    with megatron_on_cpu(context_parallel=2):
        cp = parallel_state.get_context_parallel_group()
        model = planned_with(build_mtp_gpt(config(2), layer_spec=cp_layer_spec("zigzag")), weights)
        for layout, index in runs:
            batch = batches[index]
            mine = local_rows(layout, parallel_state.get_context_parallel_rank(), 2, cu_seqlens=batch.cu_seqlens)
            params = shared_prefix_params(batch.plan(pad_to=4), cp_layout=layout)
            MTPLossLoggingHelper.tracker.clear()
            model.zero_grad()
            model.train()
            seen, hooks = layer_rows(model)
            losses = model(batch.tokens[:, mine], None, None, packed_seq_params=params, labels=batch.labels[:, mine])[0]
            for hook in hooks:
                hook.remove()
            sample = mine < batch.rows.numel()
            rows = mine[sample]
            weighting = torch.linspace(-1.0, 2.0, batch.rows.numel(), dtype=losses.dtype)
            (losses[sample] * weighting[rows]).sum().backward()
            tracker = MTPLossLoggingHelper.tracker
            logged = tracker.get("values", tracker.get("loss_values")).clone()
            mtp = torch.tensor([float(logged[d]) * masked_tokens(batch, d + 1, mine) for d in range(DEPTH)],
                               dtype=torch.float64)
            torch.distributed.all_reduce(mtp, group=cp)
            grads = collect_grads(model, summed_over=cp)
            expected = want[index]
            out[(layout, index)] = (
                relative_error(losses[sample].detach(), expected["loss"][rows]),
                relative_error(mtp, torch.tensor(expected["mtp"], dtype=torch.float64)),
                grad_error(grads, expected["grads"]), seen,
                [distinct_mtp_rows(batch, d, pad_to=4) // 2 for d in range(1, DEPTH + 1)], int(rows.numel()))
    return out


def assert_mtp_exact(ranks: list[dict], layout: str) -> None:
    if not ranks[0]:
        import pytest

        pytest.skip("megatron-core < 0.16 refuses a plan at context parallelism by name (0.13: MTP refuses packed "
                    "input)")
    for checks in ranks:
        runs = [values for (cut, _), values in checks.items() if cut == layout]
        assert runs
        for loss, mtp, grads, seen, expected, rows in runs:
            assert rows > 0 and loss < TOL and mtp < TOL and grads < GRAD_TOL, (layout, loss, mtp, grads)
            assert seen == expected, (layout, seen, expected)
