"""The slime lane's top-p replay: rollouts with slime's per-sample nuclei, the float64 reference of
slime's semantics, and one unpatched-or-fused forward_only + train_one_step, at one rank or on a
rank of a tensor-parallel world (`tp_rank`, spawned by `run_multirank`)."""
from __future__ import annotations

import logging
from typing import Any

import torch

import megatron_rl_patches

FUSED = ["slime_fused", "gpt_output_processor"]
TEMPERATURE = 0.7
TOP_P = 0.9
VOCAB = 64  # slime_kit.VOCAB


def nuclei(data: dict, seed: int) -> dict:
    """`data` with slime's per-sample nuclei: response token r keeps ids[offsets[r]:offsets[r+1]]
    (1-9 ids, the sampled token usually among them; every 4th token's nucleus lacks it, every 5th
    is empty); the last sample's offsets cover only its first half."""
    gen = torch.Generator().manual_seed(seed)
    ids_all, offsets_all = [], []
    for s, (tokens, response) in enumerate(zip(data["tokens"], data["response_lengths"])):
        targets = tokens[-response:]
        covered = response // 2 if s == len(data["tokens"]) - 1 else response
        ids, offsets = [], [0]
        for r in range(covered):
            size = int(torch.randint(1, 10, (), generator=gen))
            kept = torch.randperm(VOCAB, generator=gen)[:size].tolist()
            kept = [i for i in kept if i != int(targets[r])]
            if r % 4 != 3:
                kept.append(int(targets[r]))
            if r % 5 == 4:
                kept = []
            ids += kept
            offsets.append(len(ids))
        ids_all.append(torch.tensor(ids, dtype=torch.int32))
        offsets_all.append(torch.tensor(offsets, dtype=torch.int32))
    return {**data, "rollout_top_p_token_ids": ids_all, "rollout_top_p_token_offsets": offsets_all}


def renormalized(logps: list[torch.Tensor], data: dict) -> list[torch.Tensor]:
    """float64 slime semantics from dense [R, V] log-softmaxes: log p(target) − logsumexp over the
    nucleus and the target; tokens past the offsets unmasked."""
    out = []
    for logp, tokens, response, ids, offsets in zip(logps, data["tokens"], data["response_lengths"],
                                                     data["rollout_top_p_token_ids"],
                                                     data["rollout_top_p_token_offsets"]):
        targets = tokens[-response:]
        values = logp.gather(-1, targets[:, None])[:, 0].clone()
        for r in range(len(offsets) - 1):
            kept = set(ids[int(offsets[r]): int(offsets[r + 1])].tolist()) | {int(targets[r])}
            values[r] = values[r] - torch.logsumexp(logp[r, sorted(kept)], 0)
        out.append(values)
    return out


def forward_and_step(kit, fused: bool, *extra: str, reference: bool = True):
    from slime.backends.megatron_utils import loss as slime_loss
    from slime.backends.megatron_utils import model as slime_model

    from megatron_rl_patches.testing.vocab_watch import VocabWideTensors

    if fused:
        megatron_rl_patches.apply(only=FUSED)
    try:
        with kit.slime_session(*extra, rollout_temperature=TEMPERATURE, rollout_top_p=TOP_P, use_rollout_entropy=True,
                               entropy_coef=0.01, log_probs_chunk_size=4) as args:
            if args.allgather_cp:
                from slime_ranks import declared_dsa

                declared_dsa(args)
            model, optimizer, scheduler = kit.build(args)
            data = nuclei(kit.rollout(0), 5)
            gpt = model[0]
            while hasattr(gpt, "module"):
                gpt = gpt.module
            student = kit.float64_copy(args, [p.detach() for p in gpt.parameters()]) if reference else None
            with VocabWideTensors(vocab=kit.VOCAB) as watch:
                out = slime_model.forward_only(slime_loss.get_log_probs_and_entropy, args, model,
                                               kit.iterators(data), [len(data["micro_batch_indices"])],
                                               use_rollout_top_p_replay=True)
            with torch.no_grad():  # the float64 model is whole: one rank's reference only
                logps = kit.response_logps(student, data, TEMPERATURE) if reference else None
            step_data = nuclei(kit.rollout(0, [lp + 0.05 for lp in out["log_probs"]]), 5)
            # slime's actor hands the step this rank's context-parallel slice of per-token values
            step_data["advantages"] = [slime_loss.slice_log_prob_with_cp(a, t, r) for a, t, r in zip(
                step_data["advantages"], step_data["total_lengths"], step_data["response_lengths"])]
            for chunk in model:
                chunk.train()
            losses, grad_norm = slime_model.train_one_step(args, 0, 0, kit.iterators(step_data), model, optimizer,
                                                           scheduler, 2, 4)
            weights = [p.detach().clone() for p in model[0].parameters()]
    finally:
        megatron_rl_patches.revert()
    return out, logps, data, losses, grad_norm, weights, watch


def world_rank(rank: int, world_size: int, tensor: int, context: int, allgather: bool = False) -> dict[str, Any]:
    """One rank of a TP = `tensor` × CP = `context` (zigzag, or `--allgather-cp` with `allgather`)
    world: slime's unpatched route, then the fused one, from the same fresh weights (under TP the
    vocab, and so each nucleus, spreads over the shards; under zigzag CP each rank holds two chunks
    of every sample's rows, under allgather CP a contiguous slice of the packed stream)."""
    from slime_ranks import ALLGATHER_CP, lane_rank

    with lane_rank(rank, world_size, tensor=tensor, context=context):
        import slime_kit as kit

        result = {}
        lines: list[str] = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
        logger = logging.getLogger("megatron_rl_patches")
        logger.addHandler(handler)
        try:
            for fused in (False, True):
                out, _, _, losses, grad_norm, weights, _ = forward_and_step(
                    kit, fused, "--tensor-model-parallel-size", str(tensor), "--context-parallel-size", str(context),
                    *(ALLGATHER_CP if allgather else ()), reference=False)
                result[fused] = {"out": out, "losses": losses, "grad_norm": grad_norm, "weights": weights,
                                 "fell_back": [line for line in lines if "slime_fused:" in line]}
        finally:
            logger.removeHandler(handler)
        return result
