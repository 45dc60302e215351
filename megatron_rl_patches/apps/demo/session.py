"""One demo session: set up megatron-core, build the models, run the rollouts, measure."""
# lazy imports: import cost: the plain route imports no piece of the package (tests/apps/demo)
from __future__ import annotations

import sys
import traceback
from dataclasses import asdict, replace
from typing import Any

import torch
from tqdm import tqdm

from megatron_rl_patches.apps.demo import loop, measure, package_route, plain_route, scale
from megatron_rl_patches.apps.demo.loop import DemoConfig, RolloutResult
from megatron_rl_patches.apps.quiet import hide_import_notes
from megatron_rl_patches.testing.megatron_cpu import megatron_world
from megatron_rl_patches.testing.vocab_watch import VocabWideTensors

# The two ways a second train() call fails on megatron-core without the patches: the no_sync
# assert of Megatron-LM's / slime's train(), and DDP's hook removal finding no handle.
_REENTRY_SIGNS = (("AssertionError", "no_sync_func must be None"), ("KeyError", "disable_forward_pre_hook"))


PROGRESS_UNIT = "steps"  # a rollout's bar counts its optimizer steps as their batches are sampled


def _progress(total: int, desc: str, enabled: bool) -> Any:
    """A progress bar on a terminal only: redirected to a file, its carriage returns make one long line."""
    shown = enabled and sys.stderr is not None and sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit=PROGRESS_UNIT, disable=not shown, leave=False, file=sys.stderr)


def describe_error(exc: BaseException, rollout: int) -> dict[str, Any]:
    """The summary's record of a failed rollout; `reentry_crash` only for the known re-entry
    failures on a rollout after the first (anything else is reported as what it is)."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    name = type(exc).__name__
    reentry = rollout > 1 and any(name == kind and sign in text for kind, sign in _REENTRY_SIGNS)
    return {"rollout": rollout, "type": name, "message": str(exc) or repr(exc), "reentry_crash": reentry}


def _patch_report(route: Any) -> list[dict[str, str]]:
    """The route's patches as applied: name, status, reason code, and what each one changes."""
    if not route.PATCHES:
        return []
    import megatron_rl_patches as mrp
    from megatron_rl_patches.integrations import all_patches

    descriptions: dict[str, list[str]] = {}
    for record in all_patches():
        descriptions.setdefault(record.name, []).append(record.description)
    report: dict[str, dict[str, str]] = {}
    for status in mrp.applied():  # a patch with several targets is reported once
        if status.name in route.PATCHES and status.name not in report:
            report[status.name] = dict(status.as_dict(), description="; ".join(descriptions[status.name]))
    return list(report.values())


def _rollout_batches(cfg: DemoConfig, actor: list, teachers: list, route: Any, gen: torch.Generator,
                     watch: VocabWideTensors, bar: Any) -> list[list[dict]]:
    """Sample (the stand-in for the rollout engine: logits for one position at a time) and score."""
    step_batches = []
    for _ in range(cfg.steps):
        batches = []
        for _ in range(cfg.microbatches):
            batch = loop.sample(actor[0], cfg, gen)
            with watch:
                route.score_with_teachers(batch, actor[0], teachers, cfg)
            batches.append(batch)
        step_batches.append(batches)
        bar.update(1)
    return step_batches


def run_demo(cfg: DemoConfig, patches: bool = True, progress: bool = False) -> dict:
    """Run the loop on one route; returns the summary (JSON-ready). Without the package rollout 2
    is expected to fail: the failure is reported in the summary, not raised."""
    hide_import_notes()  # noise for a demo
    route = package_route if patches else plain_route
    torch.manual_seed(cfg.seed)
    train = route.start()
    results: list[RolloutResult] = []
    error = None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = replace(cfg, device=device)
    watch = VocabWideTensors(cfg.vocab_size)
    try:
        with megatron_world(device):
            actor, teachers = route.build_models(cfg)
            patch_report = _patch_report(route)  # after the builds imported the targets
            forward_step = route.make_forward_step(cfg)
            gen = torch.Generator().manual_seed(cfg.seed)
            for rollout in range(1, cfg.rollouts + 1):
                bar = _progress(cfg.steps, f"rollout {rollout}/{cfg.rollouts}", progress)
                step_batches = _rollout_batches(cfg, actor, teachers, route, gen, watch, bar)
                try:
                    with watch:
                        per_step = train(rollout, actor, step_batches, forward_step, cfg.lr)
                except Exception as exc:
                    error = describe_error(exc, rollout)
                    break
                finally:
                    bar.close()
                last = per_step[-1]
                results.append(RolloutResult(rollout, last["loss"], last["opd_kl"], last["entropy"], last["logprob"]))
            teacher_bytes = measure.teacher_savings(teachers, cfg)
    finally:
        route.stop()
    return {
        "ok": error is None and len(results) == cfg.rollouts,
        "patches": patches,
        "route": route.NAME,
        "patches_applied": patch_report,
        "package_pieces": list(route.PACKAGE_PIECES),
        "device": device,
        "config": asdict(cfg),
        "rollouts_completed": len(results),
        "rollouts": [asdict(r) for r in results],
        "error": error,
        "teachers": teacher_bytes,
        "vocab_wide_tensors": watch.as_dict(),
        "logits_bytes_per_microbatch": measure.logits_bytes_per_microbatch(cfg),
        "real_models": {"teachers": scale.teacher_rows(cfg.teachers),
                        "logits": scale.logits_rows(cfg.teachers, cfg.topk)},
    }
