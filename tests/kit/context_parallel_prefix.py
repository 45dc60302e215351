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


def context_parallel_served() -> bool:
    """Whether this megatron-core cuts a plan over context-parallel ranks (0.16 and later: its GPTModel
    hands the rotary embedding the plan's `cp_group`); older ones refuse it by name."""
    import re

    from megatron.core.package_info import __version__

    found = re.match(r"(\d+)\.(\d+)", str(__version__))
    return not found or (int(found[1]), int(found[2])) >= (0, 16)


def context_parallel_exactness(tensor_parallel: int, sequence_parallel: bool, runs,
                               mixed_layouts: bool = False) -> dict:
    """The plan at CP = 2 (x `tensor_parallel`) against the same samples packed whole at CP = 1 (the
    same weights): every CP rank builds the plan of the whole micro-batch and passes its own share of
    the ids, cut in each (layout, batch) of `runs`; per run (log-prob error, entropy error, the
    objective summed over the CP ranks against the whole one, the gradients summed over the CP ranks
    against the whole ones, this rank's sample rows); empty where megatron-core < 0.16. `mixed_layouts`:
    then CP rank 0 passes zigzag ids and rank 1 contiguous ones (key ("mixed", -1): the error said, or None)."""
    import torch
    from megatron.core import parallel_state

    from kit.shared_prefix import objective, ordinary
    from megatron_rl_patches import log_probs_and_entropy
    from megatron_rl_patches.shared_prefix import check_shared_prefix, prepare_shared_prefix, shared_prefix_params
    from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error
    from megatron_rl_patches.testing.cp_layout import local_rows
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu, tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    if not context_parallel_served():
        return {}
    batches = context_parallel_batches()
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
    with megatron_on_cpu(tensor_parallel=tensor_parallel, context_parallel=2):
        tp, cp = parallel_state.get_tensor_model_parallel_group(), parallel_state.get_context_parallel_group()
        model = build_packed_gpt(seq_length=512, seed=4, config=tiny_gpt_config(context_parallel_size=2, **settings),
                                 context_parallel_layout="zigzag")
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(weights[name])
        check_shared_prefix([model], training=True)
        prepare_shared_prefix(model)
        for layout, index in runs:
            batch = batches[index]
            plan = batch.plan(pad_to=4 * tensor_parallel)
            mine = local_rows(layout, parallel_state.get_context_parallel_rank(), 2, cu_seqlens=batch.cu_seqlens)
            logits = model(batch.tokens[:, mine], None, None,
                           packed_seq_params=shared_prefix_params(plan, cp_layout=layout))
            sample = mine < batch.rows.numel()
            rows = mine[sample]
            log_probs, entropy = log_probs_and_entropy(logits[0, sample], batch.labels[0, rows], tp_group=tp,
                                                       with_entropy=True)
            weights_of_rows = torch.randn(2, batch.rows.numel(), generator=torch.Generator().manual_seed(index))
            loss = (weights_of_rows[0, rows] * log_probs).sum() + (weights_of_rows[1, rows] * entropy).sum()
            loss.backward()  # `objective`'s terms at this rank's rows: summed over the CP ranks, the whole one
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
