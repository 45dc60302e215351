"""A shared-prefix plan at every layout it claims, on real megatron-core over 2 gloo ranks (one world
for the module), one-level GRPO batches and a multi-turn tree (each turn shared by the branches below
it): TP = 2, TP = 2 + sequence parallelism (the norms' gradients, each rank's share of
its rows, summed over the group as `finalize_model_grads` sums them), PP = 2 through megatron-core's real schedule
(the plan built by each stage from the micro-batch it reads, forward and backward), multi-latent
attention at TP = 2 and PP = 2, DSA sparse attention (megatron-core 0.19's) at TP = 2 + SP, MTP at
TP = 2, TP = 2 + SP and PP = 2 (its loss per depth too, each depth's layer computing the rows its
samples share once), an MoE model at EP = 2 (the
allgather dispatcher; its aux loss, z-loss and expert-bias counts and update too, each
rank its own micro-batch; and at TP = 2 + SP with EP = 2: aux, seq and global aux losses, z-loss, the
counts and the bias, Sinkhorn refused by name; the statistics and MTP over padding sequences of
varying ids, each padding row computed by its own id), each against the ordinary packed path of the
same model: log-probs within 1e-6, every gradient within 2e-6 (float32);
megatron-core's GatedDeltaNet (3 of 4 layers) at TP = 2 and TP = 2 + SP against each sample run alone;
CP = 2 (each rank its zigzag or contiguous share of the ids, the plan's stream cut over the ranks)
against the same samples packed whole at CP = 1, the gradients summed over the CP ranks; a layer
kind only one pipeline stage holds refused on both stages alike (never one rank raising while the
other waits)."""
from __future__ import annotations

import pytest

from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.multirank import run_multirank

pytestmark = [pytest.mark.megatron, pytest.mark.multirank, pytest.mark.slow]
TOL, GRAD_TOL = 1e-6, 2e-6
MICRO_BATCHES = 3


def _batches(padding_to: int = 2):
    from kit.shared_prefix import grpo_batch, tree_batch

    shapes = [(((60, (4, 9, 2, 6)),), (7,)), (((33, (5, 5)), (20, (3, 8, 1))), ()), (((70, (8,)),), (6, 3))]
    batches = []
    for seed, (groups, alone) in enumerate(shapes):
        rows = sum(p + r for p, rs in groups for r in rs) + sum(alone)
        batches.append(grpo_batch(groups, alone, padding=padding_to + (-rows) % padding_to, seed=seed))
    # a multi-turn tree (a system prompt, two turns branching 2 then 3 ways) beside a sample alone
    turns = ((6, 9, 2), (5, 7, 3))
    rows = 2 * (30 + 6 + 9) + 6 * (30 + 6 + 9 + 5 + 7) + 11  # a sample per trajectory and turn, one alone
    batches.append(tree_batch(system=30, turns=turns, alone=(11,), per_turn=True,
                              padding=padding_to + (-rows) % padding_to, seed=7))
    return batches


def _scores(logits, batch, tp_group):
    from megatron_rl_patches import log_probs_and_entropy

    rows = logits[0, batch.rows] if logits.dim() == 3 else logits[batch.rows, 0]
    return log_probs_and_entropy(rows, batch.labels[0, batch.rows], tp_group=tp_group, with_entropy=True)


def _tensor_parallel_checks(sequence_parallel: bool) -> dict:
    import torch
    from kit.shared_prefix import objective, ordinary, planned
    from megatron.core import parallel_state

    from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu, tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    out = {}
    with megatron_on_cpu(tensor_parallel=2):
        tp = parallel_state.get_tensor_model_parallel_group()
        config = tiny_gpt_config(tensor_model_parallel_size=2, sequence_parallel=sequence_parallel,
                                 num_query_groups=2)
        model = build_packed_gpt(seq_length=512, seed=4, config=config)
        for index, batch in enumerate(_batches()):
            results = []
            for route in (ordinary, lambda m, b: planned(m, b, pad_to=2)):
                log_probs, entropy = _scores(route(model, batch), batch, tp)
                objective(log_probs, entropy, seed=index).backward()
                results.append((log_probs.detach(), entropy.detach(), collect_grads(model)))
            (want_lp, want_ent, want_grads), (lp, ent, grads) = results
            for name, param in model.named_parameters():  # a rank's share of the rows: summed as
                if getattr(param, "sequence_parallel", False):  # finalize_model_grads sums them
                    for summed in (grads, want_grads):
                        torch.distributed.all_reduce(summed[name], group=tp)
            out[index] = (relative_error(lp, want_lp), relative_error(ent, want_ent), grad_error(grads, want_grads),
                          bool(torch.isfinite(lp).all()))
        from kit.shared_prefix import trie_size

        tree = _batches()[-1]  # the tree planned: each distinct leading run once
        out["tree"] = (tree.plan(pad_to=2).stats.physical_tokens, trie_size(tree.sequences))
        if sequence_parallel:  # 47 logical rows: the stream padded to 2, the rows read back cannot split
            from kit.shared_prefix import grpo_batch

            try:
                planned(model, grpo_batch(((20, (3, 4)),), (), padding=0), pad_to=2)
            except ValueError as exc:
                out["odd"] = str(exc)
    return out


def _latent_attention_checks(sequence_parallel: bool) -> dict:
    """Multi-latent attention at TP = 2 (its heads split over the ranks, the latents gathered), with
    sequence parallelism or without (each rank's share of the rows; the norms' gradients summed)."""
    import torch
    from kit.latent_gpt import build_mla_gpt, mla_takes_packed_input, tiny_mla_config
    from kit.shared_prefix import objective, ordinary, planned
    from megatron.core import parallel_state

    from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    out: dict = {}
    if not mla_takes_packed_input():
        return out
    with megatron_on_cpu(tensor_parallel=2):
        tp = parallel_state.get_tensor_model_parallel_group()
        model = build_mla_gpt(tiny_mla_config(tensor_model_parallel_size=2, sequence_parallel=sequence_parallel))
        batch = _batches()[0]
        results = []
        for route in (ordinary, lambda m, b: planned(m, b, pad_to=2)):
            log_probs, entropy = _scores(route(model, batch), batch, tp)
            objective(log_probs, entropy).backward()
            results.append((log_probs.detach(), collect_grads(model)))
        (want, want_grads), (got, grads) = results
        for name, param in model.named_parameters():
            if getattr(param, "sequence_parallel", False):
                for summed in (grads, want_grads):
                    torch.distributed.all_reduce(summed[name], group=tp)
        out["mla"] = (relative_error(got, want), grad_error(grads, want_grads), len(grads))
    return out


def _sparse_attention_checks() -> dict:
    """DSA (megatron-core 0.19's) at TP = 2 + SP (its absorbed MLA asks SP at TP > 1): the query heads split
    over the ranks, the indexer's top-k whole on each, every rank's rows gathered for it."""
    import torch
    from kit.shared_prefix import objective, ordinary, planned
    from kit.sparse_gpt import build_dsa_gpt, dsa_runs_on_cpu, tiny_dsa_config
    from megatron.core import parallel_state

    from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    out: dict = {}
    if not dsa_runs_on_cpu():
        return out
    with megatron_on_cpu(tensor_parallel=2):
        tp = parallel_state.get_tensor_model_parallel_group()
        model = build_dsa_gpt(tiny_dsa_config(tensor_model_parallel_size=2, sequence_parallel=True))
        batch = _batches()[0]
        results = []
        for route in (ordinary, lambda m, b: planned(m, b, pad_to=2)):
            model.zero_grad(set_to_none=True)
            log_probs, entropy = _scores(route(model, batch), batch, tp)
            objective(log_probs, entropy).backward()
            results.append((log_probs.detach(), entropy.detach(), collect_grads(model)))
        (want, want_ent, want_grads), (got, ent, grads) = results
        for name, param in model.named_parameters():  # the indexer learns from its loss only (off here)
            if getattr(param, "sequence_parallel", False) and name in want_grads:
                for summed in (grads, want_grads):
                    torch.distributed.all_reduce(summed[name], group=tp)
        out["dsa"] = (relative_error(got, want), relative_error(ent, want_ent), grad_error(grads, want_grads),
                      len(grads))
    return out


def _mtp_checks(sequence_parallel: bool) -> dict:
    """Multi-token prediction at TP = 2 (depth 1), or TP = 2 + SP (depth 2: each depth's rows scattered
    over the ranks), accepted by the doors on both ranks: the main loss, the MTP loss megatron-core logs
    per depth and every gradient against the packed path, over two padding sequences of varying ids
    (no loss mask: the MTP loss counts each padding row by its own id, as packed)."""
    from kit.moe_statistics import varying_padding
    from kit.mtp_gpt import build_mtp_gpt, distinct_mtp_rows, layer_rows, mtp_pass, mtp_takes_packed_input
    from kit.shared_prefix import ordinary, planned

    from megatron_rl_patches.shared_prefix import check_shared_prefix
    from megatron_rl_patches.testing.compare import grad_error, relative_error
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu, tiny_gpt_config

    out: dict = {}
    if not mtp_takes_packed_input():
        return out
    with megatron_on_cpu(tensor_parallel=2):
        config = tiny_gpt_config(mtp_num_layers=2 if sequence_parallel else 1, num_query_groups=2,
                                 tensor_model_parallel_size=2, sequence_parallel=sequence_parallel)
        model = build_mtp_gpt(config)
        check_shared_prefix([model], training=True)
        batch = varying_padding(((30, (5, 9, 3)), (8, (4, 6))), (7,), paddings=(3, 1))
        want = mtp_pass(model, batch, ordinary)
        seen, hooks = layer_rows(model)
        got = mtp_pass(model, batch, lambda m, b, **kw: planned(m, b, pad_to=4, repeated_padding_once=True, **kw))
        for hook in hooks:
            hook.remove()
        _sum_sequence_parallel_grads(model, got["grads"], want["grads"])
        ranks = 2 if sequence_parallel else 1  # each rank its share of a depth's rows
        out["mtp"] = (relative_error(got["loss"], want["loss"]), relative_error(got["mtp"], want["mtp"]),
                      grad_error(got["grads"], want["grads"]), len(want["mtp"]),
                      sum(".mtp." in f".{name}" for name in want["grads"]))
        out["rows"] = ([rows * ranks for rows in seen], [distinct_mtp_rows(batch, d + 1, ranks)
                                                         for d in range(len(seen))], batch.tokens.size(1))
    return out


def _mtp_pipeline_checks() -> dict:
    """MTP at PP = 2 through megatron-core's schedule (the block on the last stage, its embedding
    shared with the first's), accepted by the doors on both stages: the main loss, the MTP loss
    summed over the micro-batches and every gradient against the packed path."""
    import torch
    from kit.moe_statistics import constant_padding
    from kit.mtp_gpt import build_mtp_gpt, distinct_mtp_rows, layer_rows, mtp_takes_packed_input
    from kit.shared_prefix import ordinary, planned
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from megatron_rl_patches.shared_prefix import check_shared_prefix, repeated_padding_alike
    from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu
    from megatron_rl_patches.testing.pipeline import stage_flags, tiny_pipeline_config

    out: dict = {}
    if not mtp_takes_packed_input():
        return out

    def step_of(route):
        def step(iterator, model):
            batch = next(iterator)
            losses = route(model, batch, labels=batch.labels)

            def loss_func(output):
                rows = output[0, batch.rows]
                return (rows * torch.linspace(-1.0, 2.0, rows.numel())).sum(), {"loss": rows.detach()}

            return losses, loss_func

        return step

    with megatron_on_cpu(pipeline_parallel=2):
        pre, post = stage_flags()
        config = tiny_pipeline_config(2, num_layers=2, variable_seq_lengths=True, num_query_groups=2,
                                      moe_token_dispatcher_type="alltoall", mtp_num_layers=1)
        model = build_mtp_gpt(config, pre_process=pre, post_process=post)
        check_shared_prefix([model], training=True)
        once = repeated_padding_alike([model])  # agreed by both stages: each lays the padding out alike (one row)
        batches = [constant_padding(((30, (5, 9, 3)), (8, (4, 6))), (7,), padding=4, seed=seed) for seed in (0, 1)]
        runs = {}
        for name, route in (("ordinary", ordinary),
                            ("planned", lambda m, b, **kw: planned(m, b, pad_to=4, repeated_padding_once=once, **kw))):
            MTPLossLoggingHelper.tracker.clear()
            model.train()
            seen, hooks = layer_rows(model) if post else ([], [])
            reported = get_forward_backward_func()(
                forward_step_func=step_of(route), data_iterator=iter(batches), model=[model],
                num_microbatches=len(batches), seq_length=batches[0].tokens.size(1), micro_batch_size=1,
                forward_only=False)
            tracker = MTPLossLoggingHelper.tracker  # 0.19 names the loss "loss_values"
            mtp = tracker.get("values", tracker.get("loss_values"))
            for hook in hooks:
                hook.remove()
            runs[name] = ([r["loss"] for r in reported], collect_grads(model), mtp.clone() if post else None)
        if post:  # the last stage: each micro-batch's depth-1 rows
            out["rows"] = (seen, [distinct_mtp_rows(batch, 1) for batch in batches], batches[0].tokens.size(1))
        (want, want_grads, want_mtp), (got, grads, got_mtp) = runs["ordinary"], runs["planned"]
        out["once"] = once
        out["mtp"] = (max((relative_error(g, w) for g, w in zip(got, want)), default=0.0),
                      relative_error(got_mtp, want_mtp) if post else 0.0, grad_error(grads, want_grads), post,
                      sum(".mtp." in f".{name}" for name in grads))
    return out


def _sum_sequence_parallel_grads(model, *grads: dict) -> None:
    """A rank's share of the rows: the norms' gradients summed as finalize_model_grads sums them."""
    import torch
    from megatron.core import parallel_state

    for name, param in model.named_parameters():
        if getattr(param, "sequence_parallel", False):
            for summed in grads:
                torch.distributed.all_reduce(summed[name], group=parallel_state.get_tensor_model_parallel_group())


def _pipeline_step(route: str, pad_to: int = 1):
    def step(iterator, model):
        from kit.shared_prefix import objective, ordinary, planned

        batch = next(iterator)
        logits = ordinary(model, batch) if route == "ordinary" else planned(model, batch, pad_to=pad_to)

        def loss_func(output):
            log_probs, entropy = _scores(output, batch, None)
            return objective(log_probs, entropy, seed=batch.samples), {"log_probs": log_probs.detach()}

        return logits, loss_func

    return step


def _pipeline_checks() -> dict:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_rl_patches.shared_prefix import check_shared_prefix
    from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt
    from megatron_rl_patches.testing.pipeline import stage_flags, tiny_pipeline_config

    out: dict = {}
    with megatron_on_cpu(pipeline_parallel=2):
        pre, post = stage_flags()
        config = tiny_pipeline_config(2, num_layers=4, variable_seq_lengths=True, num_query_groups=2,
                                      moe_token_dispatcher_type="alltoall")  # megatron-core refuses allgather here
        model = build_packed_gpt(seq_length=512, seed=6, config=config, pre_process=pre, post_process=post)
        check_shared_prefix([model], training=True)  # agreed by both stages before the schedule
        batches = _batches()
        runs = {}
        for route in ("ordinary", "planned"):
            reported = get_forward_backward_func()(
                forward_step_func=_pipeline_step(route), data_iterator=iter(batches), model=[model],
                num_microbatches=len(batches), seq_length=batches[0].tokens.size(1), micro_batch_size=1,
                forward_only=False)
            runs[route] = ([r["log_probs"] for r in reported], collect_grads(model))
        (want, want_grads), (got, grads) = runs["ordinary"], runs["planned"]
        out["grads"] = grad_error(grads, want_grads)
        out["log_probs"] = max((relative_error(g, w) for g, w in zip(got, want)), default=0.0)
        out["last"] = post
        from megatron_rl_patches.shared_prefix import repeated_padding_alike

        alike = [repeated_padding_alike([model])]  # a run of one padding id on one row, on both stages
        # a layer kind on the second stage only: both stages refuse, with the same words
        if post:
            import torch

            class MambaMixer(torch.nn.Module):  # a recurrent layer the plan does not serve, named as megatron-core's
                def forward(self, hidden_states, packed_seq_params=None):
                    return hidden_states

            model.decoder.layers[0].recurrent = MambaMixer()
        try:
            check_shared_prefix([model], training=False)
            out["recurrent"] = None
        except ValueError as exc:
            out["recurrent"] = str(exc)
        out["alike"] = [*alike, repeated_padding_alike([model])]  # the first stage too lays it out row by row
    return out


def _latent_attention_pipeline_checks() -> dict:
    """Multi-latent attention at PP = 2 (one MLA layer a stage, each reading its own rotary table at the
    plan's positions) through megatron-core's schedule, accepted by the doors on both stages."""
    from kit.latent_gpt import build_mla_gpt, mla_takes_packed_input, tiny_mla_config
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_rl_patches.shared_prefix import check_shared_prefix
    from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu
    from megatron_rl_patches.testing.pipeline import stage_flags

    out: dict = {}
    if not mla_takes_packed_input():
        return out
    with megatron_on_cpu(pipeline_parallel=2):
        pre, post = stage_flags()
        config = tiny_mla_config(pipeline_model_parallel_size=2, variable_seq_lengths=True, batch_p2p_comm=False,
                                 moe_token_dispatcher_type="alltoall")  # megatron-core refuses allgather here
        model = build_mla_gpt(config, pre_process=pre, post_process=post)
        check_shared_prefix([model], training=True)
        batches = _batches()[:2]
        runs = {}
        for route in ("ordinary", "planned"):
            reported = get_forward_backward_func()(
                forward_step_func=_pipeline_step(route, pad_to=2), data_iterator=iter(batches), model=[model],
                num_microbatches=len(batches), seq_length=batches[0].tokens.size(1), micro_batch_size=1,
                forward_only=False)
            runs[route] = ([r["log_probs"] for r in reported], collect_grads(model))
        (want, want_grads), (got, grads) = runs["ordinary"], runs["planned"]
        log_probs = max((relative_error(g, w) for g, w in zip(got, want)), default=0.0)
        latents = sum(".linear_kv_down_proj." in f".{name}" for name in grads)
        out["mla"] = (log_probs, grad_error(grads, want_grads), latents, post, len(got))
    return out


def _expert_parallel_checks() -> dict:
    """An MoE model at EP = 2 (4 experts, 2 a rank; the allgather dispatcher), planned against ordinary."""
    import torch
    from kit.shared_prefix import objective, ordinary, planned

    from megatron_rl_patches.shared_prefix import check_shared_prefix
    from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu
    from megatron_rl_patches.testing.moe_gpt import tiny_moe_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    out = {}
    with megatron_on_cpu(expert_parallel=2):
        model = build_packed_gpt(seq_length=512, seed=9, config=tiny_moe_config(expert_parallel=2))
        check_shared_prefix([model], training=True)
        for index, batch in enumerate(_batches()):
            results = []
            for route in (ordinary, planned):
                log_probs, entropy = _scores(route(model, batch), batch, None)
                objective(log_probs, entropy, seed=index).backward()
                results.append((log_probs.detach(), collect_grads(model)))
            (want, want_grads), (got, grads) = results
            experts = [name for name in grads if "local_experts" in name]
            out[index] = (relative_error(got, want), grad_error(grads, want_grads), len(experts),
                          bool(all(torch.isfinite(g).all() for g in grads.values())))
        out["statistics"] = _expert_statistics(expert_parallel=2)
    return out


def _expert_statistics(expert_parallel: int) -> tuple:
    """An aux loss, a z-loss and expert-bias updates at once, each rank its micro-batch with two padding
    sequences of varying ids (each row counted by its own id, as packed): (log-prob error, gradient
    error, the largest logged-loss error, counts equal, bias equal after megatron's all-reduced update)."""
    import torch
    from kit.moe_statistics import STATISTICS, statistics_pass, varying_padding
    from kit.shared_prefix import ordinary, planned

    from megatron_rl_patches.testing.compare import grad_error, relative_error
    from megatron_rl_patches.testing.moe_gpt import tiny_moe_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    statistics = {**STATISTICS["aux-loss"], **STATISTICS["z-loss"], **STATISTICS["expert-bias"]}
    config = tiny_moe_config(expert_parallel=expert_parallel, **statistics)
    model = build_packed_gpt(seq_length=512, seed=9, config=config)
    batch = varying_padding(((40, (4, 9, 2)),), (6,), paddings=(2, 1), seed=torch.distributed.get_rank())
    want = statistics_pass(model, batch, ordinary)
    got = statistics_pass(model, batch, lambda m, b: planned(m, b, pad_to=2, repeated_padding_once=True))
    losses = max(relative_error(got["losses"][name], values) for name, values in want["losses"].items())
    return (relative_error(got["log_probs"], want["log_probs"]), grad_error(got["grads"], want["grads"]), losses,
            bool(got["counts"]) and all(torch.equal(g, w) for g, w in zip(got["counts"], want["counts"])),
            bool(got["bias"]) and all(torch.equal(g, w) for g, w in zip(got["bias"], want["bias"])))


def _sequence_parallel_statistics() -> dict:
    """MoE statistics in training at TP = 2 + SP with EP = 2 (each rank a share of the rows, 2 experts a
    rank), accepted by the doors on both ranks: an aux loss, z-loss and expert-bias updates in one
    model, seq_aux_loss and global_aux_loss in another, each against the packed path over two padding
    sequences of varying ids (each row counted by its own id, as packed); Sinkhorn refused by name on
    both ranks."""
    import torch
    from kit.moe_statistics import STATISTICS, statistics_pass, varying_padding
    from kit.shared_prefix import ordinary, planned
    from megatron.core import parallel_state

    from megatron_rl_patches.shared_prefix import check_shared_prefix
    from megatron_rl_patches.testing.compare import grad_error, relative_error
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu
    from megatron_rl_patches.testing.moe_gpt import tiny_moe_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    layout = dict(expert_parallel=2, tensor_model_parallel_size=2, sequence_parallel=True,
                  expert_tensor_parallel_size=1)
    kinds = {"aux-z-bias": {**STATISTICS["aux-loss"], **STATISTICS["z-loss"], **STATISTICS["expert-bias"]},
             "seq-global": dict(moe_router_load_balancing_type=["seq_aux_loss", "global_aux_loss"],
                                moe_aux_loss_coeff=[0.1, 0.05])}
    from megatron.core.transformer.moe.router import TopKRouter

    if not hasattr(TopKRouter, "reset_global_aux_loss_tracker"):  # megatron-core 0.13: one balancing type
        kinds["seq-global"] = STATISTICS["seq-aux-loss"]
    out: dict = {}
    with megatron_on_cpu(tensor_parallel=2, expert_parallel=2, expert_tensor_parallel=1):
        tp = parallel_state.get_tensor_model_parallel_group()
        batch = varying_padding(((40, (4, 9, 2)),), (6,), paddings=(2, 1))  # the same on both ranks of the TP group
        for name, statistics in kinds.items():
            model = build_packed_gpt(seq_length=512, seed=9, config=tiny_moe_config(**layout, **statistics))
            check_shared_prefix([model], training=True)
            want = statistics_pass(model, batch, ordinary, tp)
            got = statistics_pass(model, batch, lambda m, b: planned(m, b, pad_to=2, repeated_padding_once=True), tp)
            _sum_sequence_parallel_grads(model, got["grads"], want["grads"])
            out[name] = (relative_error(got["log_probs"], want["log_probs"]), grad_error(got["grads"], want["grads"]),
                         {loss: relative_error(got["losses"][loss], values) for loss, values in want["losses"].items()},
                         all(torch.equal(g, w) for g, w in zip(got["counts"], want["counts"])) and len(want["counts"]),
                         all(torch.equal(g, w) for g, w in zip(got["bias"], want["bias"])) and len(want["bias"]))
        sinkhorn = build_packed_gpt(seq_length=512, seed=9, config=tiny_moe_config(
            **layout, moe_router_load_balancing_type="sinkhorn", moe_router_topk=1))
        try:
            check_shared_prefix([sinkhorn], training=True)
            out["sinkhorn"] = None
        except ValueError as exc:
            out["sinkhorn"] = str(exc)
    return out


def _routing_replay_checks() -> tuple | None:
    """MoE routing replay at TP = 2 + SP with EP = 2 (megatron-core 0.16 on): another model's records
    (each rank its share of the rows, as it routes them) replayed packed whole and under the plan a
    host's door builds from them (`PrefixPass.records`: the shares gathered over the tensor-parallel
    group), in training with an aux loss, z-loss and expert-bias counts: (log-prob error, gradient
    error, the largest logged-loss error, counts equal, the replay changed the log-probs, the plan
    computed fewer rows and the door counted them, one rank unable to read its records, or holding records of
    another width, packing the micro-batch whole on both, before any gather)."""
    import torch
    from kit.moe_statistics import STATISTICS, statistics_pass, varying_padding
    from kit.shared_prefix import ordinary
    from megatron.core import parallel_state

    from megatron_rl_patches.integrations.megatron.shared_prefix_pass import planned_pass
    from megatron_rl_patches.shared_prefix.plan import shared_prefix_plan_of
    from megatron_rl_patches.testing.compare import grad_error, relative_error
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu
    from megatron_rl_patches.testing.moe_gpt import tiny_moe_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    try:
        from kit.routing_replay import acting, fresh_routers, recorded
        from megatron.core.transformer.moe.router_replay import RouterReplay  # noqa: F401
    except ImportError:
        return None
    statistics = {**STATISTICS["aux-loss"], **STATISTICS["z-loss"], **STATISTICS["expert-bias"]}
    layout = dict(expert_parallel=2, tensor_model_parallel_size=2, sequence_parallel=True,
                  expert_tensor_parallel_size=1, moe_enable_routing_replay=True, **statistics)
    with megatron_on_cpu(tensor_parallel=2, expert_parallel=2, expert_tensor_parallel=1):
        tp = parallel_state.get_tensor_model_parallel_group()
        batch = varying_padding(((40, (4, 9, 2)), (12, (5, 3))), (6,), paddings=(2, 1))
        fresh_routers()
        rollout = build_packed_gpt(seq_length=512, seed=13, config=tiny_moe_config(**layout)).eval()
        shares = recorded(lambda: rollout(batch.tokens, batch.positions, None, packed_seq_params=batch.thd_params()))
        whole = []
        for share in shares:  # the plan reads the whole micro-batch's records: the shares gathered over TP
            parts = [torch.empty_like(share) for _ in range(2)]
            torch.distributed.all_gather(parts, share.contiguous(), group=tp)
            whole.append(torch.cat(parts))
        fresh_routers()
        model = build_packed_gpt(seq_length=512, seed=9, config=tiny_moe_config(**layout))
        door = planned_pass("a replaying pass", [model])  # the host's door: each rank hands its share of the records
        door.records = lambda: shares

        def planned(m, b):
            return m(b.tokens, None, None, packed_seq_params=door.params(b.tokens, b.thd_params(), b.samples))

        own = statistics_pass(model, batch, ordinary, tp)
        with acting("replay_forward", shares):
            want = statistics_pass(model, batch, ordinary, tp)
        with acting("replay_forward", shares):
            got = statistics_pass(model, batch, planned, tp)
        _sum_sequence_parallel_grads(model, got["grads"], want["grads"])
        plan = batch.plan(pad_to=2, routed_experts=whole).stats
        counted = dict(door.figures)
        rank = parallel_state.get_tensor_model_parallel_rank()
        door.records = lambda: shares if rank == 0 else "this rank cannot read its records"  # one rank: both whole
        alone = door.params(batch.tokens, batch.thd_params(), batch.samples)
        door.records = lambda: shares if rank == 0 else [share[:, :1] for share in shares]  # another width: both whole
        narrow = door.params(batch.tokens, batch.thd_params(), batch.samples)
    return (relative_error(got["log_probs"], want["log_probs"]), grad_error(got["grads"], want["grads"]),
            max(relative_error(got["losses"][name], values) for name, values in want["losses"].items()),
            len(want["counts"]) == 2 and all(torch.equal(g, w) for g, w in zip(got["counts"], want["counts"])),
            relative_error(own["log_probs"], want["log_probs"]) > 1e-3,
            plan.physical_tokens < plan.logical_tokens - 40 and counted.get("physical_tokens") == plan.physical_tokens,
            shared_prefix_plan_of(alone) is None and shared_prefix_plan_of(narrow) is None
            and door.figures.get("packed_whole") == 2)


def _gated_delta_net_checks(sequence_parallel: bool) -> dict | None:
    """megatron-core's GatedDeltaNet (3 of 4 layers) planned at TP = 2 against each sample run alone
    unpacked (its packed path is refused): every sample of an even length, as SP splits each."""
    import torch
    from kit.shared_prefix import grpo_batch, objective, planned
    from megatron.core import parallel_state

    from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error
    from megatron_rl_patches.testing.gdn_gpt import (
        build_gated_delta_net_gpt,
        gated_delta_net_on_cpu,
        megatron_gated_delta_net_served,
        tiny_gated_delta_net_config,
    )
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    if not megatron_gated_delta_net_served():
        return None

    def each_alone(model, batch):
        bounds = batch.cu_seqlens[:batch.samples + 1].tolist()
        return torch.cat([model(batch.tokens[:, a:b], torch.arange(b - a)[None], None)
                          for a, b in zip(bounds, bounds[1:])], dim=1)

    with megatron_on_cpu(tensor_parallel=2), gated_delta_net_on_cpu():
        tp = parallel_state.get_tensor_model_parallel_group()
        config = tiny_gated_delta_net_config(tensor_model_parallel_size=2, sequence_parallel=sequence_parallel)
        model = build_gated_delta_net_gpt(config, seed=4)
        batch = grpo_batch(((70, (6, 2)), (2, (6, 4))), (12,), padding=4)
        seen = []  # the rows a gated delta net is handed (under SP: this rank's share)
        model.decoder.layers[0].self_attention.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[0]))
        results = []
        for route in (each_alone, lambda m, b: planned(m, b, pad_to=2)):
            log_probs, entropy = _scores(route(model, batch), batch, tp)
            objective(log_probs, entropy).backward()
            results.append((log_probs.detach(), entropy.detach(), collect_grads(model)))
        (want_lp, want_ent, want_grads), (lp, ent, grads) = results
        for name, param in model.named_parameters():
            if getattr(param, "sequence_parallel", False):
                for summed in (grads, want_grads):
                    torch.distributed.all_reduce(summed[name], group=tp)
        linear = sum(".self_attention.A_log" in name for name in grads)
        return {"log_probs": relative_error(lp, want_lp), "entropy": relative_error(ent, want_ent),
                "grads": grad_error(grads, want_grads), "linear_layers": linear,
                "rows": (seen[-1], batch.plan(pad_to=2).physical_length)}


def _gated_delta_net_pipeline_checks() -> dict | None:
    """megatron-core's GatedDeltaNet planned at PP = 2 through megatron-core's schedule (layers 1-2 on
    the first stage, 3 and the attention on the last) against it planned at PP = 1 with the same
    weights (itself equal to each sample run alone: test_planned_gated_delta_net.py); every gradient
    by its layer's global number."""
    from kit.shared_prefix import grpo_batch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_rl_patches.shared_prefix import check_shared_prefix
    from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error
    from megatron_rl_patches.testing.gdn_gpt import (
        build_gated_delta_net_gpt,
        gated_delta_net_on_cpu,
        megatron_gated_delta_net_served,
        tiny_gated_delta_net_config,
    )
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu
    from megatron_rl_patches.testing.pipeline import stage_flags

    if not megatron_gated_delta_net_served():
        return None
    batches = [grpo_batch(((70, (6, 2)), (2, (6, 4))), (12,), padding=4),
               grpo_batch(((33, (5, 1, 7)),), (9,), padding=2, seed=1)]

    def named(model) -> dict:  # each parameter by its layer's global number
        out = {}
        for name, param in model.named_parameters():
            if name.startswith("decoder.layers."):
                index, rest = name[len("decoder.layers."):].split(".", 1)
                name = f"decoder.layers.{model.decoder.layers[int(index)].layer_number - 1}.{rest}"
            out[name] = param
        return out

    def run(model, pp: int) -> tuple[list, dict]:
        reported = get_forward_backward_func()(
            forward_step_func=_pipeline_step("planned"), data_iterator=iter(batches), model=[model],
            num_microbatches=len(batches), seq_length=batches[0].tokens.size(1), micro_batch_size=1,
            forward_only=False)
        grads = {name: param.grad.clone() for name, param in named(model).items() if param.grad is not None}
        collect_grads(model)  # zeroed
        return [r["log_probs"] for r in reported], grads

    with megatron_on_cpu(), gated_delta_net_on_cpu():
        config = tiny_gated_delta_net_config(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
        model = build_gated_delta_net_gpt(config, seed=4)
        weights = {name: param.detach().clone() for name, param in named(model).items()}
        want, want_grads = run(model, 1)
    with megatron_on_cpu(pipeline_parallel=2), gated_delta_net_on_cpu():
        import torch

        pre, post = stage_flags()
        config = tiny_gated_delta_net_config(pipeline_model_parallel_size=2, variable_seq_lengths=True,
                                             batch_p2p_comm=False, moe_token_dispatcher_type="alltoall")
        model = build_gated_delta_net_gpt(config, seed=4, pre_process=pre, post_process=post)
        with torch.no_grad():
            for name, param in named(model).items():
                param.copy_(weights[name])
        check_shared_prefix([model], training=True)
        got, grads = run(model, 2)
    return {"log_probs": max((relative_error(g, w) for g, w in zip(got, want)), default=0.0), "last": post,
            "micro_batches": len(got), "grads": grad_error(grads, {name: want_grads[name] for name in grads}),
            "linear_layers": sum(".self_attention.A_log" in name for name in grads)}


def _context_parallel_checks() -> dict:
    from kit.context_parallel_prefix import context_parallel_batches, context_parallel_exactness

    return context_parallel_exactness(1, False, [(layout, index) for layout in ("zigzag", "contiguous")
                                                  for index in range(len(context_parallel_batches()))])


def _held_checks() -> dict:
    from kit.held_segments import held_checks

    return held_checks()


def _world(rank: int, world_size: int) -> dict:
    return {"held": _held_checks(), "tp2": _tensor_parallel_checks(False), "tp2-sp": _tensor_parallel_checks(True),
            "tp2-mla": _latent_attention_checks(False), "tp2-sp-mla": _latent_attention_checks(True),
            "tp2-sp-dsa": _sparse_attention_checks(),
            "tp2-mtp": _mtp_checks(False), "tp2-sp-mtp": _mtp_checks(True),
            "pp2": _pipeline_checks(), "pp2-mla": _latent_attention_pipeline_checks(),
            "pp2-mtp": _mtp_pipeline_checks(),
            "ep2": _expert_parallel_checks(), "tp2-sp-ep2": _sequence_parallel_statistics(),
            "tp2-sp-ep2-replay": _routing_replay_checks(),
            "cp2": _context_parallel_checks(), "gdn-tp2": _gated_delta_net_checks(False),
            "gdn-tp2-sp": _gated_delta_net_checks(True), "gdn-pp2": _gated_delta_net_pipeline_checks()}


@pytest.fixture(scope="module")
def world():
    return run_multirank(_world, 2, timeout=300)


@layouts.mark("tp2")
def test_tensor_parallel_equals_the_packed_path(world):
    for rank in world:
        tree, trie = rank["tp2"].pop("tree")
        assert tree == trie
        for lp, ent, grads, finite in rank["tp2"].values():
            assert finite and lp < TOL and ent < TOL and grads < GRAD_TOL


@layouts.mark("tp2", "sp")
def test_sequence_parallel_equals_the_packed_path(world):
    for rank in world:
        rank["tp2-sp"].pop("tree")
        assert rank["tp2-sp"].pop("odd", None) == ("shared prefix: under sequence parallelism the packed micro-batch "
                                                   "(47 tokens) must split evenly over the 2 tensor-parallel ranks")
        for lp, ent, grads, finite in rank["tp2-sp"].values():
            assert finite and lp < TOL and ent < TOL and grads < GRAD_TOL


@layouts.mark("tp2")
def test_multi_latent_attention_at_tensor_parallelism_equals_the_packed_path(world):
    _latent_attention_exact(world, "tp2-mla")


@layouts.mark("tp2", "sp")
def test_multi_latent_attention_under_sequence_parallelism_equals_the_packed_path(world):
    _latent_attention_exact(world, "tp2-sp-mla")


def _latent_attention_exact(world, layout: str) -> None:
    if "mla" not in world[0][layout]:
        pytest.skip("this megatron-core's MLA does not run packed input on CPU (0.13)")
    for rank in world:
        lp, grads, named = rank[layout]["mla"]
        assert named > 0 and lp < TOL and grads < GRAD_TOL, (layout, lp, grads)


@layouts.mark("tp2", "sp")
def test_sparse_attention_under_sequence_parallelism_equals_the_packed_path(world):
    if "dsa" not in world[0]["tp2-sp-dsa"]:
        pytest.skip("this megatron-core's DSA does not run packed input on CPU (0.16's refuses it)")
    for rank in world:
        lp, ent, grads, named = rank["tp2-sp-dsa"]["dsa"]
        assert named > 0 and lp < TOL and ent < TOL and grads < GRAD_TOL, (lp, ent, grads)


@layouts.mark("tp2", "mtp")
def test_mtp_at_tensor_parallelism_equals_the_packed_path(world):
    _mtp_exact(world, "tp2-mtp", depth=1)


@layouts.mark("tp2", "sp", "mtp")
def test_mtp_under_sequence_parallelism_equals_the_packed_path(world):
    _mtp_exact(world, "tp2-sp-mtp", depth=2)


@layouts.mark("pp2", "mtp")
def test_mtp_at_pipeline_parallelism_equals_the_packed_path(world):
    if "mtp" not in world[0]["pp2-mtp"]:
        pytest.skip("this megatron-core's MTP refuses packed sequences (its own assertion; 0.13)")
    first, last = (rank["pp2-mtp"]["mtp"] for rank in world)
    assert not first[3] and last[3] and first[4] == 0 and last[4] > 0  # the MTP block on the last stage
    assert all(rank["pp2-mtp"]["once"] for rank in world)  # the padding of one id on one row, on both stages
    for loss, mtp_loss, grads, *_ in (first, last):
        assert loss < TOL and mtp_loss < TOL and grads < GRAD_TOL, (loss, mtp_loss, grads)
    _computes_the_depth_rows(world[1]["pp2-mtp"]["rows"])


def _computes_the_depth_rows(rows) -> None:
    """Each depth's MTP layer computed the rows its samples share once, fewer than the packed rows."""
    seen, expected, packed = rows
    assert seen == expected and max(expected) < packed, rows


def _mtp_exact(world, layout: str, depth: int) -> None:
    if "mtp" not in world[0][layout]:
        pytest.skip("this megatron-core's MTP refuses packed sequences (its own assertion; 0.13)")
    for rank in world:
        loss, mtp_loss, grads, depths, mtp_grads = rank[layout]["mtp"]
        assert depths == depth and mtp_grads > 0, (depths, mtp_grads)
        assert loss < TOL and mtp_loss < TOL and grads < GRAD_TOL, (layout, loss, mtp_loss, grads)
        _computes_the_depth_rows(rank[layout]["rows"])


@layouts.mark("pp2")
def test_the_pipeline_carries_the_plan_through_both_stages(world):
    first, last = world
    assert not first["pp2"]["last"] and last["pp2"]["last"]
    assert last["pp2"]["log_probs"] < TOL
    for rank in world:
        assert rank["pp2"]["grads"] < GRAD_TOL  # the first stage's gradients came back through the planned p2p


@layouts.mark("pp2")
def test_megatron_cores_gated_delta_net_at_pipeline_parallelism_equals_it_on_one_stage(world):
    if world[0]["gdn-pp2"] is None:
        pytest.skip("megatron-core's GatedDeltaNet is not 0.16's megatron.core.ssm.gated_delta_net")
    first, last = (rank["gdn-pp2"] for rank in world)
    assert not first["last"] and last["last"] and last["micro_batches"] == 2
    assert last["log_probs"] < TOL
    assert (first["linear_layers"], last["linear_layers"]) == (2, 1)  # the stages' own gated delta nets
    for rank in (first, last):
        assert rank["grads"] < GRAD_TOL, rank


@layouts.mark("pp2")
def test_multi_latent_attention_at_pipeline_parallelism_equals_the_packed_path(world):
    if "mla" not in world[0]["pp2-mla"]:
        pytest.skip("this megatron-core's MLA does not run packed input on CPU (0.13)")
    first, last = (rank["pp2-mla"]["mla"] for rank in world)
    assert not first[3] and last[3] and last[4] == 2  # the last stage reports both micro-batches' log-probs
    assert last[0] < TOL
    for lp, grads, latents, *_ in (first, last):
        assert latents == 1 and grads < GRAD_TOL, (lp, grads, latents)  # each stage's own MLA layer


@layouts.mark("moe", "ep2")
def test_expert_parallelism_routes_each_token_as_packed_whole(world):
    for rank in world:
        for lp, grads, experts, finite in (v for k, v in rank["ep2"].items() if k != "statistics"):
            assert finite and experts > 0 and lp < TOL and grads < GRAD_TOL


@layouts.mark("moe", "ep2")
def test_expert_parallel_statistics_count_a_shared_token_once_per_sample(world):
    for rank in world:
        lp, grads, losses, counts, bias = rank["ep2"]["statistics"]
        assert lp < TOL and grads < GRAD_TOL and losses < TOL and counts and bias


@layouts.mark("moe", "ep2", "tp2", "sp")
def test_sequence_parallel_statistics_count_a_shared_token_once_per_sample(world):
    for rank in world:
        checks = dict(rank["tp2-sp-ep2"])
        sinkhorn = checks.pop("sinkhorn")
        assert "Sinkhorn's under sequence parallelism" in sinkhorn and sinkhorn == world[0]["tp2-sp-ep2"]["sinkhorn"]
        for name, (lp, grads, losses, *_) in checks.items():
            assert lp < TOL and grads < GRAD_TOL, (name, lp, grads)
            assert losses and all(error < TOL for error in losses.values()), (name, losses)
        assert set(checks["aux-z-bias"][2]) == {"load_balancing_loss", "z_loss"}
        logged = set(checks["seq-global"][2])  # global's too where megatron-core has it; 0.13 logs seq's unnamed
        assert logged >= {"seq_load_balancing_loss"} or logged == {"load_balancing_loss"}, logged
        assert checks["aux-z-bias"][3] == checks["aux-z-bias"][4] == 2  # both layers' counts and updated bias


@layouts.mark("moe", "ep2", "tp2", "sp")
def test_routing_replay_under_sequence_and_expert_parallelism_equals_the_packed_path(world):
    if world[0]["tp2-sp-ep2-replay"] is None:
        pytest.skip("this megatron-core has no routing replay (moe_enable_routing_replay: 0.16 on)")
    for rank in world:
        lp, grads, losses, counts, replayed, shared, one_rank_whole = rank["tp2-sp-ep2-replay"]
        assert lp < TOL and grads < GRAD_TOL and losses < TOL and counts and replayed and shared and one_rank_whole


@layouts.mark("pp2")
def test_a_layer_kind_on_one_stage_is_refused_on_both(world):
    reasons = [rank["pp2"]["recurrent"] for rank in world]
    assert reasons[0] == reasons[1] and "Mamba layers" in reasons[0]
    assert [rank["pp2"]["alike"] for rank in world] == [[True, False]] * 2  # agreed: padding laid out alike


@pytest.mark.parametrize("layout", [pytest.param("zigzag", marks=layouts.mark("cp2-zigzag")),
                                    pytest.param("contiguous", marks=layouts.mark("cp2-allgather"))])
def test_context_parallelism_equals_the_samples_packed_whole(world, layout):
    from kit.context_parallel_prefix import assert_exact

    assert_exact([rank["cp2"] for rank in world], layout)


@layouts.mark("tp2", "sp")
@pytest.mark.parametrize("layout", ["gdn-tp2", "gdn-tp2-sp"])
def test_gated_delta_nets_continue_each_prefix_over_tensor_parallel_ranks(world, layout):
    if world[0][layout] is None:
        pytest.skip("megatron-core's GatedDeltaNet is not 0.16's megatron.core.ssm.gated_delta_net")
    for rank in world:
        checks = rank[layout]
        assert checks["linear_layers"] == 3
        rows, physical = checks["rows"]
        assert rows == (physical // 2 if layout.endswith("-sp") else physical)
        assert checks["log_probs"] < TOL and checks["entropy"] < TOL and checks["grads"] < GRAD_TOL


@layouts.mark("tp2", "sp")
def test_held_segments_under_sequence_parallelism_equal_the_packed_path(world):
    for rank in world:
        log_probs, grads, left = rank["held"]["tp2-sp"]
        assert log_probs < TOL and grads < GRAD_TOL and not left


def test_held_segments_through_the_schedule_at_data_parallelism_reduce_the_packed_gradient(world):
    for rank in world:  # each rank its own cuts: its side passes and recomputes its own
        assert rank["held"]["dp2"][0] < GRAD_TOL


@layouts.mark("cp2-zigzag", "cp2-allgather")
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_held_segments_at_context_parallelism_equal_the_packed_path(world, layout):
    if not world[0]["held"][f"cp2-{layout}"]:
        pytest.skip("megatron-core < 0.16 refuses a plan at context parallelism by name")
    for rank in world:
        log_probs, grads, left = rank["held"][f"cp2-{layout}"]
        assert log_probs < TOL and grads < GRAD_TOL and not left


@layouts.mark("ep2", "moe")
def test_held_segments_at_expert_parallelism_agree_their_passes_and_count_statistics(world):
    for rank in world:
        log_probs, grads, losses, counts, bias, side, owned = rank["held"]["ep2"]
        assert log_probs < TOL and grads < GRAD_TOL and losses < TOL and counts and bias
        # rank 0 owns the prompt in its third micro-batch, rank 1 in its second: both run both recomputes
        assert (side, owned) == ([2, 0, 0], [0, 2, 2])
