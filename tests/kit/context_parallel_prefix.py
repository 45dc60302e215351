"""Shared-prefix plans under context parallelism, checked in the multi-rank worlds of
tests/shared_prefix (test_layouts.py: CP = 2; test_context_parallel_layouts.py: CP = 2 x TP = 2):
micro-batches as megatron-core's zigzag takes them and the run of the plan at CP = 2 against the
same samples packed whole at CP = 1, with the same weights."""
from __future__ import annotations

TOL, GRAD_TOL = 1e-6, 2e-6


def context_parallel_batches():
    """Micro-batches as megatron-core's zigzag takes them: every sequence (samples, the padding last)
    a multiple of 2 * CP = 4 rows; one-level groups and a multi-turn tree."""
    from kit.shared_prefix import grpo_batch, tree_batch

    return [grpo_batch(((60, (4, 8, 12, 4)),), (8,), padding=4, seed=0),
            grpo_batch(((33, (3, 7)), (21, (3, 7, 11))), (), padding=8, seed=1),
            tree_batch(system=28, turns=((4, 8, 2), (4, 4, 3)), alone=(12,), per_turn=True, padding=4, seed=7)]


def context_parallel_batches_of_four():
    """Micro-batches for CP = 4: every sequence (samples, the padding last) a multiple of 2 * CP = 8
    rows; a group of four, a sample alone, and two groups."""
    from kit.shared_prefix import grpo_batch

    return [grpo_batch(((60, (4, 12, 4, 12)),), (8,), padding=8, seed=0),
            grpo_batch(((33, (7, 15)), (21, (3, 11, 19))), (), padding=8, seed=1)]


def context_parallel_served() -> bool:
    """Whether this megatron-core cuts a plan over context-parallel ranks (0.16 and later: its GPTModel
    hands the rotary embedding the plan's `cp_group`); older ones refuse it by name."""
    import re

    from megatron.core.package_info import __version__

    found = re.match(r"(\d+)\.(\d+)", str(__version__))
    return not found or (int(found[1]), int(found[2])) >= (0, 16)


def context_parallel_exactness(tensor_parallel: int, sequence_parallel: bool, runs,
                               mixed_layouts: bool = False, context_parallel: int = 2) -> dict:
    """The plan at CP = `context_parallel` (x `tensor_parallel`; CP = 4: `context_parallel_batches_of_four`,
    else `context_parallel_batches`) against the same samples packed whole at CP = 1 (the
    same weights): every CP rank builds the plan of the whole micro-batch and passes its own share of
    the ids, cut in each (layout, batch) of `runs`; per run (log-prob error, entropy error, the
    objective summed over the CP ranks against the whole one, the gradients summed over the CP ranks
    against the whole ones, this rank's sample rows); empty where megatron-core < 0.16. `mixed_layouts`:
    then CP rank 0 passes zigzag ids and rank 1 contiguous ones (key ("mixed", -1): the error said, or None)."""
    import torch
    from megatron.core import parallel_state

    from kit.shared_prefix import objective, ordinary
    from megatron_rl_patches import log_probs_and_entropy
    from megatron_rl_patches.shared_prefix import shared_prefix_params
    from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error
    from megatron_rl_patches.testing.cp_layout import local_rows
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu, tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    if not context_parallel_served():
        return {}
    batches = context_parallel_batches_of_four() if context_parallel == 4 else context_parallel_batches()
    settings = dict(num_query_groups=2, tensor_model_parallel_size=tensor_parallel,
                    sequence_parallel=sequence_parallel)

    def norms_summed(model, grads):  # each TP rank's share of the rows, summed as finalize_model_grads does
        for name, param in model.named_parameters():
            if getattr(param, "sequence_parallel", False):
                torch.distributed.all_reduce(grads[name], group=parallel_state.get_tensor_model_parallel_group())
        return grads

    want = {}
    with megatron_on_cpu(tensor_parallel=tensor_parallel):
        tp = parallel_state.get_tensor_model_parallel_group()
        model = build_packed_gpt(seq_length=512, seed=4, config=tiny_gpt_config(**settings))
        weights = {name: param.detach().clone() for name, param in model.named_parameters()}
        for index in sorted({index for _, index in runs}):
            batch = batches[index]
            log_probs, entropy = log_probs_and_entropy(ordinary(model, batch)[0, batch.rows],
                                                       batch.labels[0, batch.rows], tp_group=tp, with_entropy=True)
            loss = objective(log_probs, entropy, seed=index)
            loss.backward()
            want[index] = (log_probs.detach(), entropy.detach(), float(loss), norms_summed(model, collect_grads(model)))
    out = {}
    with megatron_on_cpu(tensor_parallel=tensor_parallel, context_parallel=context_parallel):
        tp, cp = parallel_state.get_tensor_model_parallel_group(), parallel_state.get_context_parallel_group()
        config = tiny_gpt_config(context_parallel_size=context_parallel, **settings)
        model = planned_with(build_packed_gpt(seq_length=512, seed=4, context_parallel_layout="zigzag", config=config),
                             weights)
        for layout, index in runs:
            batch = batches[index]
            rows, log_probs, entropy, loss = rank_step(model, batch, layout, index, tensor_parallel, tp,
                                                       context_parallel)
            summed = loss.detach().clone()
            torch.distributed.all_reduce(summed, group=cp)
            want_lp, want_ent, want_loss, want_grads = want[index]
            grads = norms_summed(model, collect_grads(model, summed_over=cp))
            out[(layout, index)] = (relative_error(log_probs, want_lp[rows]), relative_error(entropy, want_ent[rows]),
                                    abs(float(summed) - want_loss) / max(1.0, abs(want_loss)),
                                    grad_error(grads, want_grads), int(rows.numel()))
        if mixed_layouts:  # each rank its own share of the ids, cut as it says: the ranks disagree
            batch, cp_rank = batches[0], parallel_state.get_context_parallel_rank()
            layout = ("zigzag", "contiguous")[cp_rank]
            mine = local_rows(layout, cp_rank, 2, cu_seqlens=batch.cu_seqlens)
            try:
                model(batch.tokens[:, mine], None, None, packed_seq_params=shared_prefix_params(
                    batch.plan(pad_to=4 * tensor_parallel), cp_layout=layout))
                out[("mixed", -1)] = None
            except ValueError as exc:
                out[("mixed", -1)] = str(exc)
    return out


def assert_exact(ranks: list[dict], layout: str) -> None:
    """Every rank's runs of `layout` (`context_parallel_exactness`'s answers): log-probs, entropy,
    the objective and every gradient (summed over the CP ranks) within tolerance, on sample rows of
    each rank's own."""
    if not ranks[0]:
        import pytest

        pytest.skip("megatron-core < 0.16 refuses a plan at context parallelism by name")
    for checks in ranks:
        runs = [values for (cut, _), values in checks.items() if cut == layout]
        assert runs and all(values[-1] > 0 for values in runs)
        for lp, ent, loss, grads, _ in runs:
            assert lp < TOL and ent < TOL and loss < TOL and grads < GRAD_TOL, (layout, lp, ent, loss, grads)


def beside_exactness(build, parallel: dict, batches: list, runs, statistics: bool = False) -> dict:
    """A model feature beside CP = 2: `build(cp)` makes the model at context-parallel size `cp` under the
    parallel state `parallel` (megatron_on_cpu's keywords) widened by CP; the plan at CP = 2 (each rank
    its `layout` share of the ids) against the same samples packed whole at CP = 1, the same weights.
    Per (layout, index) of `runs`: (log-prob error, entropy error, objective error, gradient error, this
    rank's sample rows) and, with `statistics`, ({logged MoE loss: error}, how many routers' token counts
    are equal, and their bias after megatron's update; 0 where one differs), the losses and counts over
    the ranks that split the rows (TP and CP) as megatron-core's tracker and update reduce them.
    Where the expert-parallel group is the context-parallel one (EP = CP = 2, TP = 1) an expert's
    gradient already holds every CP rank's tokens (not summed again), and at CP = 1 both EP ranks ran
    the whole batch (halved); where it is the tensor-parallel one (under SP) it is summed as the rest."""
    import torch
    from megatron.core import parallel_state

    from kit.moe_statistics import read_statistics, reset_statistics
    from kit.shared_prefix import objective, ordinary
    from megatron_rl_patches import log_probs_and_entropy
    from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    def norms_summed(model, grads):  # each TP rank's share of the rows, summed as finalize_model_grads does
        for name, param in model.named_parameters():
            if getattr(param, "sequence_parallel", False):
                torch.distributed.all_reduce(grads[name], group=parallel_state.get_tensor_model_parallel_group())
        return grads

    def reported(statistics: dict, groups: list) -> dict:
        """The logged losses over the ranks holding shares of the rows (`groups`), as megatron-core's
        tracker reports them: a balancing loss summed (its reduce group), the z-loss (a mean over each
        rank's equal share) averaged; the token counts summed."""
        for counts in statistics["counts"]:
            for group in groups:
                torch.distributed.all_reduce(counts, group=group)
        for name, values in statistics["losses"].items():
            for group in groups:
                torch.distributed.all_reduce(values, group=group)
                if name == "z_loss":
                    values /= torch.distributed.get_world_size(group)
        return statistics

    def experts_of(model) -> set:  # megatron-core marks an expert's parameters not all-reduced over data
        return {name for name, param in model.named_parameters() if not getattr(param, "allreduce", True)}

    want = {}
    with megatron_on_cpu(**parallel):
        tp = parallel_state.get_tensor_model_parallel_group()
        model = build(1)
        weights = {name: param.detach().clone() for name, param in model.named_parameters()}
        for index in sorted({index for _, index in runs}):
            batch = batches[index]
            before = reset_statistics(model) if statistics else None
            model.train()
            log_probs, entropy = log_probs_and_entropy(ordinary(model, batch)[0, batch.rows],
                                                       batch.labels[0, batch.rows], tp_group=tp, with_entropy=True)
            loss = objective(log_probs, entropy, seed=index)
            loss.backward()
            want[index] = (log_probs.detach(), entropy.detach(), float(loss), norms_summed(model, collect_grads(model)),
                           reported(read_statistics(model, before), [tp]) if statistics else None)
    out = {}
    with megatron_on_cpu(**parallel, context_parallel=2):
        tp, cp = parallel_state.get_tensor_model_parallel_group(), parallel_state.get_context_parallel_group()
        ranks = torch.distributed.get_process_group_ranks
        experts_over_cp = (parallel.get("expert_parallel", 1) > 1
                           and ranks(parallel_state.get_expert_model_parallel_group()) == ranks(cp))
        model = planned_with(build(2), weights)
        for layout, index in runs:
            batch = batches[index]
            before = reset_statistics(model) if statistics else None
            model.train()
            tensor_parallel = parallel.get("tensor_parallel", 1)
            rows, log_probs, entropy, loss = rank_step(model, batch, layout, index, tensor_parallel, tp)
            summed = loss.detach().clone()
            torch.distributed.all_reduce(summed, group=cp)
            want_lp, want_ent, want_loss, _, want_statistics = want[index]
            grads = norms_summed(model, collect_grads(model))
            experts = experts_of(model) if experts_over_cp else set()
            for name in set(grads) - experts:
                torch.distributed.all_reduce(grads[name], group=cp)
            want_grads = {name: grad / 2 if name in experts else grad for name, grad in want[index][3].items()}
            checks = (relative_error(log_probs, want_lp[rows]), relative_error(entropy, want_ent[rows]),
                      abs(float(summed) - want_loss) / max(1.0, abs(want_loss)), grad_error(grads, want_grads),
                      int(rows.numel()))
            if statistics:
                got = reported(read_statistics(model, before), [tp, cp])
                losses = {name: relative_error(values, want_statistics["losses"][name])
                          for name, values in got["losses"].items()}
                equal = {kind: len(got[kind]) if all(torch.equal(g, w) for g, w in zip(got[kind],
                                                                                       want_statistics[kind]))
                         else 0 for kind in ("counts", "bias")}  # how many routers' are equal (0: one differs)
                checks += (losses, equal["counts"], equal["bias"])
            out[(layout, index)] = checks
    return out


def pipeline_exactness(layout: str = "zigzag", build_stage=None) -> dict:
    """CP = 2 x PP = 2 through megatron-core's schedule (variable_seq_lengths; each stage runs its CP
    rank's share of the physical stream, the last gathers and reads this rank's logical rows) against
    PP = 2 at CP = 1 with the same weights (the model: the packed dense GPT, or `build_stage(cp,
    pre_process, post_process)`'s stage): the log-probs the last stage reports per micro-batch at
    this rank's rows, and every gradient summed over the CP ranks (the schedule scales a CP rank's loss
    by the CP size, so the sum is halved). (log-prob error, gradient error, last stage, micro-batches)."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from kit.shared_prefix import ordinary
    from megatron_rl_patches import log_probs_and_entropy
    from megatron_rl_patches.shared_prefix import check_shared_prefix, prepare_shared_prefix, shared_prefix_params
    from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error
    from megatron_rl_patches.testing.cp_layout import local_rows
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt
    from megatron_rl_patches.testing.pipeline import stage_flags, tiny_pipeline_config

    if not context_parallel_served():
        return {}
    batches = context_parallel_batches()[:2]

    def build(cp: int):
        pre, post = stage_flags()
        if build_stage is not None:
            return build_stage(cp, pre, post), post
        config = tiny_pipeline_config(2, num_layers=2, variable_seq_lengths=True, context_parallel_size=cp,
                                      num_query_groups=2, moe_token_dispatcher_type="alltoall")
        return build_packed_gpt(seq_length=512, seed=6, config=config, pre_process=pre, post_process=post,
                                context_parallel_layout=layout if cp > 1 else None), post

    def run(model, forward):
        def step(iterator, model):
            batch = next(iterator)
            logits, rows = forward(model, batch)

            def loss_func(output):
                log_probs, entropy = log_probs_and_entropy(output[0, rows >= 0], batch.labels[0, rows[rows >= 0]],
                                                           with_entropy=True)
                weights = torch.randn(2, batch.rows.numel(), generator=torch.Generator().manual_seed(batch.samples))
                kept = rows[rows >= 0]
                loss = (weights[0, kept] * log_probs).sum() + (weights[1, kept] * entropy).sum()
                return loss, {"log_probs": log_probs.detach(), "rows": kept}

            return logits, loss_func

        return get_forward_backward_func()(forward_step_func=step, data_iterator=iter(batches), model=[model],
                                           num_microbatches=len(batches), seq_length=batches[0].tokens.size(1),
                                           micro_batch_size=1, forward_only=False)

    def whole(model, batch):
        rows = torch.full((batch.tokens.size(1),), -1)
        rows[batch.rows] = batch.rows
        return ordinary(model, batch), rows

    with megatron_on_cpu(pipeline_parallel=2):
        model, post = build(1)
        weights = {name: param.detach().clone() for name, param in model.named_parameters()}
        reported = run(model, whole)
        want = [r["log_probs"] for r in reported] if post else []
        want_grads = collect_grads(model)
    with megatron_on_cpu(pipeline_parallel=2, context_parallel=2):
        cp = parallel_state.get_context_parallel_group()
        model, post = build(2)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(weights[name])
        check_shared_prefix([model], training=True)
        prepare_shared_prefix(model)

        def planned_share(model, batch):
            mine = local_rows(layout, parallel_state.get_context_parallel_rank(), 2, cu_seqlens=batch.cu_seqlens)
            rows = torch.where(mine < batch.rows.numel(), mine, torch.full_like(mine, -1))
            params = shared_prefix_params(batch.plan(pad_to=4), cp_layout=layout)
            return model(batch.tokens[:, mine], None, None, packed_seq_params=params), rows

        reported = run(model, planned_share)
        grads = {name: grad / 2 for name, grad in collect_grads(model, summed_over=cp).items()}
        errors = [relative_error(r["log_probs"], w[r["rows"]]) for r, w in zip(reported, want)] if post else []
    return {"log_probs": max(errors, default=0.0), "grads": grad_error(grads, want_grads), "last": post,
            "micro_batches": len(reported)}


def rank_step(model, batch, layout: str, index: int, tensor_parallel: int, tp, context_parallel: int = 2):
    """This CP rank's planned step on `batch` (`context_parallel` ranks): its `layout` share of the ids
    through `model`, the log-probs and entropy at its sample rows and `objective`'s terms there,
    backward (summed over the CP ranks: the whole objective). Returns (rows, log_probs, entropy, loss)."""
    import torch
    from megatron.core import parallel_state

    from megatron_rl_patches import log_probs_and_entropy
    from megatron_rl_patches.shared_prefix import shared_prefix_params
    from megatron_rl_patches.testing.cp_layout import local_rows

    plan = batch.plan(pad_to=2 * context_parallel * tensor_parallel)
    mine = local_rows(layout, parallel_state.get_context_parallel_rank(), context_parallel,
                      cu_seqlens=batch.cu_seqlens)
    logits = model(batch.tokens[:, mine], None, None, packed_seq_params=shared_prefix_params(plan, cp_layout=layout))
    sample = mine < batch.rows.numel()
    rows = mine[sample]
    log_probs, entropy = log_probs_and_entropy(logits[0, sample], batch.labels[0, rows], tp_group=tp, with_entropy=True)
    weights_of_rows = torch.randn(2, batch.rows.numel(), generator=torch.Generator().manual_seed(index))
    loss = (weights_of_rows[0, rows] * log_probs).sum() + (weights_of_rows[1, rows] * entropy).sum()
    loss.backward()
    return rows, log_probs, entropy, loss


def planned_with(model, weights: dict):
    """`model` holding `weights` (the CP = 1 model's, by name), checked and prepared for a sharing plan."""
    import torch

    from megatron_rl_patches.shared_prefix import check_shared_prefix, prepare_shared_prefix

    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    check_shared_prefix([model], training=True)
    return prepare_shared_prefix(model)
