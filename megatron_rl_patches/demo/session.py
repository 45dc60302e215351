"""One demo session: set up megatron-core, build the models, run the rollouts, measure."""
from __future__ import annotations

import sys
import warnings
from dataclasses import asdict, replace
from typing import Any

import torch

from megatron_rl_patches.demo import loop
from megatron_rl_patches.demo.loop import DemoConfig, RolloutResult
from megatron_rl_patches.testing.megatron_cpu import megatron_world


def _progress(total: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, leave=False, file=sys.stderr)


def run_demo(cfg: DemoConfig, patches: bool = True, progress: bool = False) -> dict:
    """Run the loop; returns the summary (JSON-ready). Without patches, rollout 2 is expected to
    fail: the failure is reported in the summary, not raised."""
    import megatron_rl_patches as mrp
    from megatron_rl_patches.demo import measure

    # megatron-core warns about missing Transformer Engine / Apex and torch about renamed
    # collectives on every import: noise for a demo.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    torch.manual_seed(cfg.seed)
    train = loop.megatron_style_train
    if patches:
        mrp.apply(only=["ddp_hooks"])
        train = mrp.reentrant_train(train)
    results: list[RolloutResult] = []
    error = None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with megatron_world(device):
        cfg = replace(cfg, device=device)
        actor, teachers = loop.build_models(cfg)
        forward_step = loop.make_forward_step(cfg)
        gen = torch.Generator().manual_seed(cfg.seed)
        for rollout in range(1, cfg.rollouts + 1):
            bar = _progress(cfg.steps * cfg.microbatches + 1, f"rollout {rollout}/{cfg.rollouts}", progress)
            step_batches = []
            for _ in range(cfg.steps):
                batches = []
                for _ in range(cfg.microbatches):
                    batch = loop.sample(actor[0], cfg, gen)
                    loop.score_with_teachers(batch, actor[0], teachers, cfg)
                    batches.append(batch)
                    bar.update(1)
                step_batches.append(batches)
            try:
                per_step = train(rollout, actor, step_batches, forward_step, cfg.lr)
            except Exception as exc:  # the crash --no-patches demonstrates
                bar.close()
                error = {"rollout": rollout, "type": type(exc).__name__, "message": str(exc) or repr(exc)}
                break
            bar.update(1)
            bar.close()
            last = per_step[-1]
            results.append(RolloutResult(rollout, last["loss"], last["opd_kl"], last["entropy"], last["logprob"]))
        teacher_bytes = measure.teacher_savings(teachers, cfg)
        logprob_bytes = measure.logprob_saved_bytes(cfg)
    if patches:
        mrp.revert()
    return {
        "ok": error is None and len(results) == cfg.rollouts,
        "patches": patches,
        "device": device,
        "config": asdict(cfg),
        "rollouts_completed": len(results),
        "rollouts": [asdict(r) for r in results],
        "error": error,
        "teachers": teacher_bytes,
        "logprob_saved_bytes": logprob_bytes,
    }
