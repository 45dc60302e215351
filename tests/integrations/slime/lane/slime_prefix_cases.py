"""More shared-prefix cases in the slime lane's existing `train_actor` worlds (issues 111 and 112):
after the world's own case, each further case is slime's real `train_actor` again in the same
ranks, with its own rollouts and flags (multi-turn trees; a DeepSeek-shaped model with multi-latent
attention, MoE with expert-bias updates and an aux loss, and one MTP layer). Spawned ranks import it
by name."""
from __future__ import annotations

from typing import Any

import torch

PROMPTS = (24, 28)  # two GRPO groups of four
RESPONSES = ((5, 9, 3, 7), (6, 4, 8, 2))
MICRO_BATCHES = (((0, 1, 2, 3), (4, 5, 6, 7)), ((0, 1, 2), (3, 4, 5, 6, 7)))  # the second splits a group


def grpo_rollouts(vocab: int, seed_base: int = 40) -> list[dict]:
    """Two rollouts of two groups of four samples sharing their group's prompt (slime's per-sample
    fields; one masked response token per sample)."""
    rollouts = []
    for seed, micro_batches in enumerate(MICRO_BATCHES):
        gen = torch.Generator().manual_seed(seed_base + seed)
        tokens, totals, lengths, masks, advantages = [], [], [], [], []
        for prompt_length, responses in zip(PROMPTS, RESPONSES):
            prompt = torch.randint(0, vocab, (prompt_length,), generator=gen)
            for response in responses:
                tokens.append(torch.cat([prompt, torch.randint(0, vocab, (response,), generator=gen)]))
                totals.append(prompt_length + response)
                lengths.append(response)
                mask = torch.ones(response, dtype=torch.int)
                mask[response // 2] = 0
                masks.append(mask)
                advantages.append(torch.randn(response, generator=gen))
        rollouts.append({"tokens": tokens, "total_lengths": totals, "response_lengths": lengths, "loss_masks": masks,
                         "advantages": advantages, "micro_batch_indices": [list(m) for m in micro_batches]})
    return rollouts


# A DeepSeek-shaped student (megatron-core's MLA on the kit's packed core, unfused and non-interleaved
# RoPE; 4 experts top-2 with a sigmoid router whose expert bias moves and an aux loss; one MTP layer
# trained as slime trains it, with slime's MTP loss scaling)
DEEPSEEK_SHAPED = (
    "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "12", "--qk-head-dim", "8",
    "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6", "--rope-type", "rope", "--normalization", "RMSNorm",
    "--qk-layernorm", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
    "0.01", "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.1", "--disable-bias-linear",
    "--mtp-num-layers", "1", "--enable-mtp-training", "--mtp-loss-scaling-factor", "0.2",
)  # fmt: skip


def _timer_reset() -> None:
    from slime.observability.timer import Timer

    Timer().start_time.pop("train_wait", None)  # one Timer per process: the run before left it started


def step_and_more(rank: int, world_size: int, cases: dict[str, dict[str, Any]], *args: Any) -> dict[str, Any]:
    """`slime_ranks.opd_train_actor(rank, world_size, *args)`, then each case: the same call with the
    case's keywords in place of those arguments (its "flags" added to the world's), its result under
    the case's name."""
    import inspect

    import slime_ranks

    result = slime_ranks.opd_train_actor(rank, world_size, *args)
    world = inspect.signature(slime_ranks.opd_train_actor).bind(rank, world_size, *args).arguments
    for name, keywords in cases.items():
        _timer_reset()
        call = {**world, **keywords, "flags": (*world.get("flags", ()), *keywords.get("flags", ()))}
        result[name] = slime_ranks.opd_train_actor(**call)
    return result


def close(got, want, tol: float = 1e-6) -> bool:
    """`got` equals `want` (nested lists, tuples and dicts of tensors, floats and other values): integer
    tensors exactly, float tensors and floats within `tol` of their scale (max |diff| / max(1, max |want|))."""
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(close(g, w, tol) for g, w in zip(got, want))
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(close(got[k], want[k], tol) for k in want)
    if isinstance(want, torch.Tensor):
        if want.dtype in (torch.int64, torch.int32, torch.bool):
            return torch.equal(got, want)
        scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
        return got.shape == want.shape and (got.numel() == 0 or float((got - want).abs().max()) <= tol * scale)
    if isinstance(want, float):
        return abs(got - want) <= tol * max(1.0, abs(want))
    return got == want
