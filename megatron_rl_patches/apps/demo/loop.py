"""The demo's RL loop, shared by both routes: a Megatron-style train() written
for one call per job, on-policy sampling and the reward baseline. What differs between running
with and without the package (builds, scoring, loss) is in `package_route` and `plain_route`."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl_patches.apps.demo.config import DemoConfig as DemoConfig  # the loop's configuration, re-exported
from megatron_rl_patches.testing import megatron_cpu as kit

ACTOR_DDP_FLAGS = dict(overlap_grad_reduce=True, use_distributed_optimizer=True, overlap_param_gather=True)


@dataclass
class RolloutResult:
    rollout: int
    loss: float
    opd_kl: float
    entropy: float
    logprob: float


def megatron_style_train(
    rollout_id: int,
    model: Sequence[Any],
    step_batches: Sequence[Sequence[dict]],
    forward_step: Callable,
    lr: float,
) -> list[dict[str, float]]:
    """What Megatron-LM's and slime's train() do around the schedule, written for one call per
    job: sync functions installed behind an assert, forward-pre-hooks off at entry, on after
    step 0, off at exit. Called once per rollout it fails on rollout 2 without our patches."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0])
    ddp_config = model[0].ddp_config
    if ddp_config.overlap_grad_reduce:
        assert config.no_sync_func is None, (
            "When overlap_grad_reduce is True, config.no_sync_func must be None; "
            "a custom no_sync_func is not supported when overlapping grad-reduce"
        )
        sync = [chunk.no_sync for chunk in model]
        config.no_sync_func = sync[0] if len(model) == 1 else sync
    config.finalize_model_grads_func = finalize_model_grads
    toggles_hooks = ddp_config.use_distributed_optimizer and ddp_config.overlap_param_gather
    if toggles_hooks:
        for chunk in model:
            chunk.disable_forward_pre_hook()
    per_step = []
    for step, batches in enumerate(step_batches):
        for chunk in model:
            chunk.zero_grad_buffer()
        metrics = kit.run_schedule(model, batches, forward_step)
        kit.sgd_step(model, lr)
        per_step.append({key: float(sum(m[key] for m in metrics) / len(metrics)) for key in metrics[0]})
        if step == 0 and toggles_hooks:
            for chunk in model:
                chunk.enable_forward_pre_hook()
    if toggles_hooks:
        for chunk in model:
            chunk.disable_forward_pre_hook()
    return per_step


def build_actor(cfg: DemoConfig) -> Any:
    """The actor's GPTModel, on the run's device (both routes wrap it in the same DDP)."""
    return kit.build_tiny_gpt(vocab_size=cfg.vocab_size, seq_length=cfg.seq_length, seed=cfg.seed).to(cfg.device)


def teacher_provider(cfg: DemoConfig, index: int) -> Callable:
    """Teacher `index`'s model provider. A larger init scale gives peaked next-token distributions,
    far from the near-uniform fresh actor: the distillation signal shows within a few steps."""
    config = kit.tiny_gpt_config(init_method_std=cfg.teacher_init_std)
    return kit.tiny_gpt_provider(config, vocab_size=cfg.vocab_size, seq_length=cfg.seq_length,
                                 seed=cfg.seed + 100 + index)


def _shifted_targets(tokens: torch.Tensor) -> torch.Tensor:
    """Next-token targets for every position of [b, s]; the last position gets a dummy id (masked)."""
    return torch.roll(tokens, -1, dims=1)


@torch.no_grad()
def sample(model: Any, cfg: DemoConfig, gen: torch.Generator) -> dict:
    """On-policy samples: random prompts, responses drawn token by token from the actor."""
    b, s = cfg.micro_batch_size, cfg.seq_length
    batch = kit.make_batch(b, s, cfg.vocab_size, seed=int(torch.randint(0, 2**31, (1,), generator=gen)))
    batch = {key: value.to(cfg.device) for key, value in batch.items()}
    tokens = batch["tokens"]
    for pos in range(cfg.prompt_length, s):
        logits = kit.gpt_forward(model, {**batch, "tokens": tokens})[:, pos - 1].float().cpu() / cfg.temperature
        tokens[:, pos] = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).squeeze(-1).to(cfg.device)
    loss_mask = torch.zeros(b, s, device=cfg.device)
    loss_mask[:, cfg.prompt_length - 1 : s - 1] = 1.0  # positions whose next token is a response token
    batch.update(tokens=tokens, labels=_shifted_targets(tokens), loss_mask=loss_mask)
    return batch


def centered(reward: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Reward minus its mean over the response tokens (a baseline: lower-variance gradient)."""
    return (reward - (reward * mask).sum() / mask.sum().clamp_min(1.0)) * mask


def teacher_advantages(batch: dict, old_logp: torch.Tensor,
                       teacher_token_logps: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-token advantage [b, s]: log q_mix(y) - log p_old(y) for the sampled token y, where q_mix
    is the uniform mixture of the teachers, minus its mean over the response tokens."""
    mixture = torch.logsumexp(torch.stack([lp.reshape(-1) for lp in teacher_token_logps]), 0)
    mixture = mixture - math.log(len(teacher_token_logps))
    reward = mixture - old_logp.reshape(-1)
    return centered(reward, batch["loss_mask"].reshape(-1)).reshape(batch["tokens"].shape)


def rl_loss(cfg: DemoConfig, batch: dict, logp: torch.Tensor, entropy: torch.Tensor, opd: torch.Tensor):
    """The actor's loss from per-token terms (each [b*s] or [b, s]): REINFORCE with the teacher
    reward plus the top-k OPD term, averaged over response tokens; entropy is a metric only."""
    logp, entropy, opd = (t.reshape(-1) for t in (logp, entropy, opd))
    mask = batch["loss_mask"].reshape(-1)
    denom = mask.sum().clamp_min(1.0)
    pg = -batch["advantages"].reshape(-1) * logp
    loss = ((cfg.pg_coef * pg + cfg.opd_coef * opd) * mask).sum() / denom
    return loss, {
        "loss": loss.detach().clone(),
        "opd_kl": (opd.detach() * mask).sum() / denom,
        "entropy": (entropy.detach() * mask).sum() / denom,
        "logprob": (logp.detach() * mask).sum() / denom,
    }
