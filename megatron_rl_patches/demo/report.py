"""The demo's summary as a human-readable table."""
from __future__ import annotations

from megatron_rl_patches.presentation import mib as _mib


def format_summary(summary: dict) -> str:
    cfg = summary["config"]
    lines = [
        f"megatron-rl-patches demo ({'with' if summary['patches'] else 'WITHOUT'} patches, {summary['device']})",
        f"rollouts completed: {summary['rollouts_completed']} / {cfg['rollouts']}",
    ]
    if summary["rollouts"]:
        lines.append(f"{'rollout':>8} {'loss':>10} {'OPD KL':>10} {'entropy':>10} {'log-prob':>10}")
        for r in summary["rollouts"]:
            lines.append(f"{r['rollout']:>8} {r['loss']:>10.4f} {r['opd_kl']:>10.4f} {r['entropy']:>10.4f} {r['logprob']:>10.4f}")
    error = summary["error"]
    if error:
        lines.append(
            f"rollout {error['rollout']} failed: {error['type']}: {error['message']}\n"
            "  This is the re-entry crash megatron-rl-patches fixes: run the demo without --no-patches."
        )
    t = summary["teachers"]
    per = t["trainable_build_bytes_per_teacher"]
    lines += [
        f"teachers ({t['count']} x {t['params_per_teacher']:,} params, inference-only): "
        f"saved {_mib(t['saved_bytes'])} = {t['count']} x (grad buffer {_mib(per['grad_buffer'])} "
        f"+ Adam state {_mib(per['optimizer_state'])}) counted on a trainable build "
        f"(formula {_mib(t['formula_bytes_per_teacher'])} each); allocated {_mib(t['allocated_bytes'])}",
    ]
    lp = summary["logprob_saved_bytes"]
    lines.append(
        f"log-prob path, bytes saved for backward on [{lp['tokens']}, {lp['vocab']}] logits: "
        f"naive {_mib(lp['naive'])}, ours {_mib(lp['ours_entropy_metric'])} (entropy metric), "
        f"{_mib(lp['ours_entropy_grad'])} (entropy with grad)"
    )
    return "\n".join(lines)
