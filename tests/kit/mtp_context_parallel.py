"""MTP beside context parallelism under a sharing plan, checked in the 4-rank world of
tests/shared_prefix/test_context_parallel_layouts.py: a GPTModel with a 2-deep MTP block at CP = 2
(each rank its zigzag or contiguous share of the ids and labels) against the same samples packed
whole at CP = 1 with the same weights. megatron-core divides each rank's MTP loss by the rank's own
masked tokens, so both runs sum per token (`calculate_per_token_loss`): the ranks' losses and
gradients then add up to the whole ones."""
from __future__ import annotations

TOL, GRAD_TOL = 1e-6, 2e-6


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


def dense_mtp_gpt(cp: int, **settings):
    """A dense GPTModel with a 2-deep MTP block at context-parallel size `cp` (`settings`: the config's)."""
    from kit.mtp_gpt import build_mtp_gpt
    from megatron_rl_patches.testing.cp_attention import cp_layer_spec
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config

    config = tiny_gpt_config(mtp_num_layers=2, num_query_groups=2, calculate_per_token_loss=True,
                             context_parallel_size=cp, **settings)
    return build_mtp_gpt(config, layer_spec=cp_layer_spec("zigzag") if cp > 1 else None)


def latent_moe_mtp_gpt(cp: int):
    """glm4.7-30B-A3B's kind (slime's script): multi-latent attention, MoE with expert bias at update rate 0
    (sigmoid scores, no aux loss), one MTP layer mirroring the MLA + MoE layer, at context-parallel size `cp`."""
    from kit.latent_gpt import build_mla_gpt, tiny_mla_config

    config = tiny_mla_config(mtp_num_layers=1, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                             moe_token_dispatcher_type="allgather", add_bias_linear=False,
                             moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0,
                             moe_router_score_function="sigmoid", calculate_per_token_loss=True,
                             context_parallel_size=cp)
    return build_mla_gpt(config, context_parallel_layout="zigzag" if cp > 1 else None)


def per_rank_mtp_scaling() -> bool:
    """Whether megatron-core scales each rank's per-token MTP loss by the rank's own token counts (0.19's
    `process_mtp_loss`: its share's tokens before the roll over those after), so that the ranks'
    gradients add up to its packed path's at the same cut only, not to one rank's."""
    import inspect

    from megatron.core.transformer import multi_token_prediction

    process = getattr(multi_token_prediction, "process_mtp_loss", None)
    return process is not None and "original_num_tokens" in inspect.getsource(process)


def mtp_beside_context_parallelism(runs, build=dense_mtp_gpt, packed_at_cp2: bool = True,
                                   tensor_parallel: int = 1) -> dict:
    """The model `build(cp)` makes (the same weights at CP = 1 and 2) under a plan at CP = 2, each rank
    its `layout` share of the ids and labels, against megatron-core's own packed path: zigzag (with
    `packed_at_cp2`: the kit's CPU context-parallel attention runs the model) against its packed path at
    CP = 2 (its own context-parallel MTP roll; each rank's MTP loss per depth as it logs it), else
    against the samples packed whole at CP = 1 (the ranks' MTP losses times their masked tokens summed;
    the gradients where megatron-core sums per-token MTP losses as they are).
    Per (layout, batch index) of `runs`: (main per-token loss error at this rank's sample rows, MTP loss
    error, the gradient error (summed over the CP ranks; None where megatron-core scales each rank's MTP
    gradient by its own counts), this rank's rows each depth's layer ran, the rows its share of each
    depth's stream holds (counted independently of the plan), this rank's sample rows). Empty where
    megatron-core does not cut a plan over CP ranks or its MTP refuses packed input. `tensor_parallel`:
    the world's TP size (the model's own settings say SP); the norms' gradients summed over it."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from kit.context_parallel_prefix import context_parallel_served, planned_with
    from kit.mtp_gpt import distinct_mtp_rows, layer_rows, mtp_pass, mtp_takes_packed_input
    from kit.shared_prefix import ordinary
    from megatron_rl_patches.shared_prefix import shared_prefix_params
    from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error
    from megatron_rl_patches.testing.cp_layout import local_rows
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    if not context_parallel_served() or not mtp_takes_packed_input():
        return {}
    batches = mtp_batches()

    want = {}
    def norms_summed(model, grads):  # each TP rank's share of the rows, summed as finalize_model_grads does
        for name, param in model.named_parameters():
            if getattr(param, "sequence_parallel", False) and name in grads:
                torch.distributed.all_reduce(grads[name], group=parallel_state.get_tensor_model_parallel_group())
        return grads

    with megatron_on_cpu(tensor_parallel=tensor_parallel):
        model = build(1)
        depth = int(model.config.mtp_num_layers)
        weights = {name: param.detach().clone() for name, param in model.named_parameters()}
        for index in sorted({index for layout, index in runs if not (layout == "zigzag" and packed_at_cp2)}):
            batch = batches[index]
            whole = mtp_pass(model, batch, ordinary)
            whole["grads"] = norms_summed(model, whole["grads"])
            everything = torch.arange(batch.tokens.size(1))
            whole["mtp"] = torch.tensor([float(whole["mtp"][d]) * masked_tokens(batch, d + 1, everything)
                                         for d in range(depth)], dtype=torch.float64)
            want[index] = whole
    out = {}
    with megatron_on_cpu(tensor_parallel=tensor_parallel, context_parallel=2):
        cp = parallel_state.get_context_parallel_group()
        model = planned_with(build(2), weights)

        def rank_pass(batch, mine, params, positions=None):
            """(losses at the sample rows, each depth's MTP loss as logged, gradients summed over CP, rows
            each MTP layer ran, the sample rows) of this rank's share `mine` of `batch`."""
            MTPLossLoggingHelper.tracker.clear()
            model.train()
            seen, hooks = layer_rows(model)
            losses = model(batch.tokens[:, mine], positions, None, packed_seq_params=params,
                           labels=batch.labels[:, mine])[0]
            for hook in hooks:
                hook.remove()
            sample = mine < batch.rows.numel()
            rows = mine[sample]
            weighting = torch.linspace(-1.0, 2.0, batch.rows.numel(), dtype=losses.dtype)
            (losses[sample] * weighting[rows]).sum().backward()
            tracker = MTPLossLoggingHelper.tracker
            logged = tracker.get("values", tracker.get("loss_values")).to(torch.float64)
            grads = norms_summed(model, collect_grads(model, summed_over=cp))
            return losses[sample].detach(), logged, grads, seen, rows

        for layout, index in runs:
            batch = batches[index]
            mine = local_rows(layout, parallel_state.get_context_parallel_rank(), 2, cu_seqlens=batch.cu_seqlens)
            packed = layout == "zigzag" and packed_at_cp2
            if packed:  # megatron-core's own packed path at CP = 2, the same rows on each rank
                loss, mtp, grads, _, _ = rank_pass(batch, mine, batch.thd_params(), batch.positions[:, mine])
                expected = {"loss": loss, "mtp": mtp, "grads": grads}
            got_loss, logged, got_grads, seen, rows = rank_pass(
                batch, mine, shared_prefix_params(batch.plan(pad_to=4 * tensor_parallel), cp_layout=layout))
            if packed:
                got_mtp, want_loss = logged, expected["loss"]
            else:
                expected = want[index]
                got_mtp = logged * torch.tensor([masked_tokens(batch, d + 1, mine) for d in range(depth)],
                                                dtype=torch.float64)
                torch.distributed.all_reduce(got_mtp, group=cp)
                want_loss = expected["loss"][rows]
            summed = packed or not per_rank_mtp_scaling()
            out[(layout, index)] = (
                relative_error(got_loss, want_loss), relative_error(got_mtp, expected["mtp"]),
                grad_error(got_grads, expected["grads"]) if summed else None, seen,
                [distinct_mtp_rows(batch, d, pad_to=4 * tensor_parallel) // (2 * tensor_parallel)
                 for d in range(1, depth + 1)], int(rows.numel()))
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
            assert rows > 0 and loss < TOL and mtp < TOL and (grads is None or grads < GRAD_TOL), (
                layout, loss, mtp, grads)
            assert seen == expected, (layout, seen, expected)


def mtp_pipeline_context_parallelism() -> dict:
    """MTP at CP = 2 x PP = 2 through megatron-core's schedule (the block on the last stage, its embedding
    shared with the first's): the plan (each CP rank its zigzag share of the ids and labels) against
    megatron-core's own packed path at the same layout, the same model and weights. (main loss error over
    the micro-batches, MTP loss error as this rank logs it, gradient error summed over the CP ranks, last
    stage, rows each micro-batch's MTP layer ran on this rank, the rows its share of the depth's stream
    holds). Empty where megatron-core does not cut a plan over CP ranks or its MTP refuses packed input."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from kit.context_parallel_prefix import context_parallel_served
    from kit.mtp_gpt import build_mtp_gpt, distinct_mtp_rows, layer_rows, mtp_takes_packed_input
    from megatron_rl_patches.shared_prefix import check_shared_prefix, prepare_shared_prefix, shared_prefix_params
    from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error
    from megatron_rl_patches.testing.cp_attention import cp_layer_spec
    from megatron_rl_patches.testing.cp_layout import local_rows
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu
    from megatron_rl_patches.testing.pipeline import stage_flags, tiny_pipeline_config

    if not context_parallel_served() or not mtp_takes_packed_input():
        return {}
    batches = mtp_batches()

    def step_of(planned: bool):
        def step(iterator, model):
            batch = next(iterator)
            mine = local_rows("zigzag", parallel_state.get_context_parallel_rank(), 2, cu_seqlens=batch.cu_seqlens)
            if planned:
                params = shared_prefix_params(batch.plan(pad_to=4), cp_layout="zigzag")
                losses = model(batch.tokens[:, mine], None, None, packed_seq_params=params,
                               labels=batch.labels[:, mine])
            else:
                losses = model(batch.tokens[:, mine], batch.positions[:, mine], None,
                               packed_seq_params=batch.thd_params(), labels=batch.labels[:, mine])
            sample = mine < batch.rows.numel()

            def loss_func(output):
                rows = output[0, sample]
                weighting = torch.linspace(-1.0, 2.0, batch.rows.numel(), dtype=rows.dtype)[mine[sample]]
                return (rows * weighting).sum(), {"loss": rows.detach()}

            return losses, loss_func

        return step

    with megatron_on_cpu(pipeline_parallel=2, context_parallel=2):
        cp = parallel_state.get_context_parallel_group()
        pre, post = stage_flags()
        config = tiny_pipeline_config(2, num_layers=2, variable_seq_lengths=True, num_query_groups=2,
                                      moe_token_dispatcher_type="alltoall", mtp_num_layers=1, context_parallel_size=2)
        model = build_mtp_gpt(config, layer_spec=cp_layer_spec("zigzag"), pre_process=pre, post_process=post)
        check_shared_prefix([model], training=True)
        prepare_shared_prefix(model)
        runs = {}
        for planned in (False, True):
            MTPLossLoggingHelper.tracker.clear()
            model.train()
            seen, hooks = layer_rows(model) if post else ([], [])
            reported = get_forward_backward_func()(
                forward_step_func=step_of(planned), data_iterator=iter(batches), model=[model],
                num_microbatches=len(batches), seq_length=batches[0].tokens.size(1), micro_batch_size=1,
                forward_only=False)
            tracker = MTPLossLoggingHelper.tracker
            mtp = tracker.get("values", tracker.get("loss_values"))
            for hook in hooks:
                hook.remove()
            runs[planned] = ([r["loss"] for r in reported], collect_grads(model, summed_over=cp),
                             mtp.clone() if post else None, seen)
        (want, want_grads, want_mtp, _), (got, grads, got_mtp, seen) = runs[False], runs[True]
    return {"loss": max((relative_error(g, w) for g, w in zip(got, want)), default=0.0),
            "mtp": relative_error(got_mtp, want_mtp) if post else 0.0, "grads": grad_error(grads, want_grads),
            "last": post, "rows": seen, "expected": [distinct_mtp_rows(b, 1, pad_to=4) // 2 for b in batches] if post
            else [], "micro_batches": len(got)}
