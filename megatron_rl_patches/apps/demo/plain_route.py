"""The demo without the package, as a user without it writes the step: no patch applied, teachers
built the way Megatron builds a trainable model (wrapped in DDP, grad buffers allocated), and every
log-prob, entropy and top-k bucket computed from full [T, V] logits with plain torch. Only the CPU
test kit's shims (which let megatron-core run without a GPU) remain."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_rl_patches.apps.demo import loop
from megatron_rl_patches.apps.demo.loop import DemoConfig
from megatron_rl_patches.testing import megatron_cpu as kit

NAME = "WITHOUT megatron-rl-patches"
PATCHES: tuple[str, ...] = ()
PACKAGE_PIECES: tuple[str, ...] = ()


def start() -> Callable:
    return loop.megatron_style_train


def stop() -> None:
    pass


def build_models(cfg: DemoConfig) -> tuple[list, list]:
    actor = [kit.wrap_ddp(loop.build_actor(cfg), **loop.ACTOR_DDP_FLAGS)]
    teachers = [kit.wrap_ddp(loop.teacher_provider(cfg, j)().to(cfg.device)) for j in range(cfg.teachers)]
    return actor, teachers


def _log_softmax(logits: torch.Tensor, cfg: DemoConfig) -> torch.Tensor:
    return torch.log_softmax(logits.float().reshape(-1, cfg.vocab_size) / cfg.temperature, dim=-1)


def _buckets(log_probs: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """[T, k+1]: the log-probs at the k ids, then the tail (log-sum-exp of every other id); padded
    ids (mask False) are empty buckets and their mass stays in the tail."""
    if mask is None:
        mask = torch.ones_like(ids, dtype=torch.bool)
    safe = torch.where(mask, ids, 0)
    marked = torch.zeros_like(log_probs).scatter_add_(1, safe, mask.to(log_probs.dtype)) > 0  # counts: no overwrite
    rest = log_probs.masked_fill(marked, -math.inf)
    at_ids = log_probs.gather(1, safe).masked_fill(~mask, -math.inf)
    return torch.cat([at_ids, torch.logsumexp(rest, dim=1, keepdim=True)], dim=1)


def _union(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 2k] ids: a's, then b's not in a, padded with -1 (mask False), written out by hand."""
    new = ~(b[:, :, None] == a[:, None, :]).any(-1)
    order = torch.argsort((~new).int(), dim=1, stable=True)
    new = new.gather(1, order)
    return torch.cat([a, torch.where(new, b.gather(1, order), -1)], 1), torch.cat([torch.ones_like(new), new], 1)


@torch.no_grad()
def score_with_teachers(batch: dict, actor: Any, teachers: Sequence[Any], cfg: DemoConfig) -> None:
    targets = batch["labels"].reshape(-1, 1)
    old_logp = _log_softmax(kit.gpt_forward(actor, batch), cfg)
    teacher_logp = [_log_softmax(kit.gpt_forward(t, batch), cfg) for t in teachers]
    chooser = teacher_logp[0] if cfg.ids_from == "teacher" else old_logp
    ids, mask = torch.topk(chooser, cfg.topk, dim=1).indices, None
    if cfg.ids_from == "union":
        ids, mask = _union(ids, torch.topk(teacher_logp[0], cfg.topk, dim=1).indices)
    buckets = [_buckets(lp, ids, mask) for lp in teacher_logp]
    batch.update(
        topk_ids=ids.reshape(*batch["tokens"].shape, ids.shape[-1]),
        ids_mask=None if mask is None else mask.reshape(*batch["tokens"].shape, ids.shape[-1]),
        teacher_logprobs=torch.stack([b[:, :-1] for b in buckets]),
        teacher_tails=torch.stack([b[:, -1] for b in buckets]),
        advantages=loop.teacher_advantages(batch, old_logp.gather(1, targets),
                                           [lp.gather(1, targets) for lp in teacher_logp]),
    )


def make_forward_step(cfg: DemoConfig) -> Callable:
    """Logits out of the model; log-softmax, entropy and the reverse KL over the k + 1 buckets
    against the uniform teacher mixture, all on [T, V] tensors."""

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        logits = kit.gpt_forward(model, batch)

        def loss_func(output: torch.Tensor):
            log_probs = _log_softmax(output, cfg)
            logp = log_probs.gather(1, batch["labels"].reshape(-1, 1)).squeeze(1)
            entropy = -(log_probs.exp() * log_probs).sum(-1)
            k = batch["topk_ids"].shape[-1]
            mask = None if batch["ids_mask"] is None else batch["ids_mask"].reshape(-1, k)
            student = _buckets(log_probs, batch["topk_ids"].reshape(-1, k), mask)
            teachers = torch.cat([batch["teacher_logprobs"], batch["teacher_tails"][..., None]], dim=-1)
            mixture = torch.logsumexp(teachers, dim=0) - math.log(teachers.shape[0])
            empty = torch.isneginf(student)  # padded ids of a union: 0·log 0 = 0
            safe, safe_mix = student.masked_fill(empty, 0.0), mixture.masked_fill(empty, 0.0)
            opd = torch.where(empty, 0.0, safe.exp() * (safe - safe_mix)).sum(-1)
            return loop.rl_loss(cfg, batch, logp, entropy, opd)

        return logits, loss_func

    return forward_step
