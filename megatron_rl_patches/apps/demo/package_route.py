"""The demo with the package: the DDP hook patch and the GPTModel output-processor backport
applied, the demo's train() made re-entrant by `reentrant_train`, teachers built inference-only,
and every log-prob, entropy and top-k bucket taken from hidden states by the fused output
processors (no [T, V] logits while scoring or training)."""
# lazy imports: import cost: the plain route imports no piece of the package (tests/apps/demo)
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_rl_patches.apps.demo import loop
from megatron_rl_patches.apps.demo.loop import DemoConfig
from megatron_rl_patches.testing import megatron_cpu as kit

NAME = "with megatron-rl-patches"
PATCHES = ("ddp_hooks", "gpt_output_processor")
# What the route uses besides the patches, as the summary reports it.
PACKAGE_PIECES = (
    "reentrant_train: the demo's own train() made safe to call once per rollout",
    "build_inference_model: teachers without DDP, grad buffers or optimizer",
    "topk_output_processor + log_prob_output_processor: teachers' and actor's top-k buckets, "
    "log-probs and entropy from hidden states",
    "topk_kl: the (k+1)-bucket OPD loss",
)


def start() -> Callable:
    """Apply the patches; returns the train() to call once per rollout."""
    import megatron_rl_patches as mrp

    mrp.apply(only=list(PATCHES))
    return mrp.reentrant_train(loop.megatron_style_train)


def stop() -> None:
    import megatron_rl_patches as mrp

    mrp.revert()


def build_models(cfg: DemoConfig) -> tuple[list, list]:
    """The actor in real DDP (overlap + distributed-optimizer flags); teachers inference-only, their
    weights in host memory and streamed to the device layer by layer."""
    from megatron_rl_patches import build_inference_model

    actor = [kit.wrap_ddp(loop.build_actor(cfg), **loop.ACTOR_DDP_FLAGS)]
    teachers = [build_inference_model(loop.teacher_provider(cfg, j), residency="stream")[0]
                for j in range(cfg.teachers)]
    return actor, teachers


def _both(topk: Callable, log_prob: Callable) -> Callable:
    """One output processor returning both results; the context (the ids to score) is the top-k's."""

    def process(*, context=None, **kwargs):
        result = dict(log_prob(**kwargs))
        result.update(topk(context=context, **kwargs))
        return result

    return process


def _forward(model: Any, batch: dict, processor: Callable, context: dict | None = None) -> dict:
    return model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                 output_processor=processor, output_processor_context=context)


def _processors(cfg: DemoConfig, *, select: bool, entropy: bool, union: bool = False) -> Callable:
    from megatron_rl_patches import log_prob_output_processor, topk_output_processor

    options = dict(temperature=cfg.temperature, chunk_size=cfg.tile_rows)
    topk = topk_output_processor(k=cfg.topk if select else None, union=union, **options)
    return _both(topk, log_prob_output_processor(with_entropy=entropy, entropy_requires_grad=False, **options))


@torch.no_grad()
def score_with_teachers(batch: dict, actor: Any, teachers: Sequence[Any], cfg: DemoConfig) -> None:
    """Top-k ids (the first teacher's, the old policy's, or their union), every teacher's log-probs
    at those ids + tail and at the sampled tokens, the old policy's log-probs: all from hidden
    states. Union: the old policy's ids go to the first teacher's pass, which adds its own top-k
    (padding masked); the other teachers score the union with the mask."""
    from megatron_rl_patches import log_prob_output_processor

    ids = mask = None
    if cfg.ids_from in ("student", "union"):  # one old-policy forward gives the ids and the log-probs
        old = _forward(actor, batch, _processors(cfg, select=True, entropy=False))
        old_logp, ids = old["log_probs"], old["topk_ids"]
    else:
        options = dict(temperature=cfg.temperature, chunk_size=cfg.tile_rows)
        old_logp = _forward(actor, batch, log_prob_output_processor(**options))["log_probs"]
    scored = []
    for teacher in teachers:
        if ids is None or (cfg.ids_from == "union" and mask is None):  # the first teacher selects
            union = cfg.ids_from == "union"
            out = _forward(teacher, batch, _processors(cfg, select=True, entropy=False, union=union),
                           {"ids": ids} if union else None)
            ids, mask = out["topk_ids"], out.get("ids_mask")
        else:  # the others score them
            out = _forward(teacher, batch, _processors(cfg, select=False, entropy=False),
                           {"ids": ids, "ids_mask": mask})
        scored.append(out)
    k = ids.shape[-1]
    batch.update(
        topk_ids=ids,
        ids_mask=mask,
        teacher_logprobs=torch.stack([out["topk_log_probs"].reshape(-1, k) for out in scored]),
        teacher_tails=torch.stack([out["tail"].reshape(-1) for out in scored]),
        advantages=loop.teacher_advantages(batch, old_logp, [out["log_probs"] for out in scored]),
    )


def make_forward_step(cfg: DemoConfig) -> Callable:
    """The schedule's forward step: the actor's forward returns its buckets, log-probs and entropy
    through the fused processors; the loss is `rl_loss` with `topk_kl` as the OPD term."""
    from megatron_rl_patches import topk_kl

    processor = _processors(cfg, select=False, entropy=True)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = _forward(model, batch, processor, {"ids": batch["topk_ids"], "ids_mask": batch["ids_mask"]})

        def loss_func(out: dict):
            k = batch["topk_ids"].shape[-1]
            mask = None if batch["ids_mask"] is None else batch["ids_mask"].reshape(-1, k)
            opd = topk_kl(out["topk_log_probs"].reshape(-1, k), out["tail"].reshape(-1),
                          batch["teacher_logprobs"], batch["teacher_tails"], ids_mask=mask)
            return loop.rl_loss(cfg, batch, out["log_probs"], out["entropy"], opd)

        return output, loss_func

    return forward_step
