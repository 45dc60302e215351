"""The demo's summary as text: what ran, what crashed, what the package did, what it saves."""
from __future__ import annotations

from megatron_rl_patches.apps.presentation import human_bytes, mib, text_table


def _header(summary: dict) -> list[str]:
    cfg = summary["config"]
    lines = [f"megatron-rl-patches demo: {summary['route']} ({summary['device']})"]
    if summary["patches_applied"]:
        lines.append("patches (megatron_rl_patches.apply(only=[...]), wrapt post-import hooks):")
        for patch in summary["patches_applied"]:
            why = f" ({patch['reason']})" if patch["reason"] else ""
            lines.append(f"  {patch['name']}: {patch['status']}{why} - {patch['description']}")
    else:
        lines.append("patches: none applied; no builder, wrapper or loss of the package used "
                     "(only the CPU test kit's shims, which let megatron-core run without a GPU)")
    for piece in summary["package_pieces"]:
        lines.append(f"  uses {piece}")
    lines.append(f"rollouts completed: {summary['rollouts_completed']} / {cfg['rollouts']}"
                 f" (train() called once per rollout)")
    return lines


def _rollouts(summary: dict) -> list[str]:
    if not summary["rollouts"]:
        return []
    rows = [[str(r["rollout"])] + [f"{r[key]:.4f}" for key in ("loss", "opd_kl", "entropy", "logprob")]
            for r in summary["rollouts"]]
    return [text_table(("rollout", "loss", "OPD KL", "entropy", "log-prob"), rows, numeric=True, rule=False)]


def _error(summary: dict) -> list[str]:
    error = summary["error"]
    if not error:
        return []
    lines = [f"rollout {error['rollout']} failed: {error['type']}: {error['message']}"]
    if error["reentry_crash"] and not summary["patches"]:
        lines.append("  This is the re-entry crash megatron-rl-patches fixes: the set-up in a Megatron-style "
                     "train() is not safe to run a second time.")
    elif error["reentry_crash"]:
        lines.append("  This is the re-entry crash, WITH the patches applied: please report it.")
    return lines


def _memory(summary: dict) -> list[str]:
    cfg, t = summary["config"], summary["teachers"]
    per = t["trainable_build_bytes_per_teacher"]
    trainable = (f"a trainable build holds {mib(per['grad_buffer'])} grad buffer + {mib(per['optimizer_state'])} "
                 f"Adam state each (formula {mib(t['formula_bytes_per_teacher'])})")
    if summary["patches"]:
        lines = [f"teachers ({t['count']} x {t['params_per_teacher']:,} params, inference-only): hold "
                 f"{mib(t['allocated_bytes'])} of grads; {trainable}; saved {mib(t['saved_bytes'])}"]
    else:
        lines = [f"teachers ({t['count']} x {t['params_per_teacher']:,} params, trainable builds in DDP): hold "
                 f"{mib(t['allocated_bytes'])} of grad buffers, and an optimizer would add its state; {trainable}"]
    logits, watch = summary["logits_bytes_per_microbatch"], summary["vocab_wide_tensors"]
    tokens = cfg["micro_batch_size"] * cfg["seq_length"]
    shape = "x".join(map(str, watch["largest_shape"])) or "none"
    if summary["patches"]:
        lines.append(
            f"[T, V] logits never allocated per micro-batch (T = {tokens}, V = {cfg['vocab_size']}, fp32): "
            f"actor {mib(logits['actor'])} (training and old-policy forwards), teachers "
            f"{mib(logits['teachers'])}; largest vocab-wide tensor allocated while scoring and training: "
            f"[{shape}] ({mib(watch['largest_bytes'])}, a logits tile of {cfg['tile_rows']} rows)")
    else:
        lines.append(
            f"[T, V] logits allocated while scoring and training: {mib(logits['total'])} per micro-batch "
            f"(T = {tokens}, V = {cfg['vocab_size']}, fp32: the actor's two forwards and each teacher's); "
            f"largest vocab-wide tensor [{shape}] ({mib(watch['largest_bytes'])})")
    return lines


def _real_models(summary: dict) -> list[str]:
    real = summary["real_models"]
    n = summary["config"]["teachers"]
    rows = [[r["model"], str(r["dp"]), "yes" if r["distributed_optimizer"] else "no",
             human_bytes(r["per_teacher_bytes"]), human_bytes(r["saved_bytes"])] for r in real["teachers"]]
    lines = [text_table(("model", "DP", "dist. opt.", "per teacher", f"{n} teachers"), rows,
                        title="at real size, per GPU: training state inference-only teachers do not hold "
                              "(bf16 weights, fp32 grads, Adam; `megatron-rl-patches memory`)")]
    rows = [[r["model"], f"{r['vocab']:,} ({r['vocab_from']})", human_bytes(r["actor_logits_bytes"]),
             human_bytes(r["teacher_logits_bytes"]), human_bytes(r["fused_bytes_per_model"])] for r in real["logits"]]
    tokens = real["logits"][0]["tokens"]
    lines.append(text_table(("model", "V", "actor logits", f"{n} teachers' logits", "fused, per model"), rows,
                            title=f"at real size, per micro-batch of {tokens:,} tokens (TP = 1): bf16 [T, V] "
                                  "logits the fused processors never allocate"))
    return lines


def format_summary(summary: dict, real_models: bool = True) -> str:
    """One route's summary; `real_models`: with the tables scaled to real model sizes."""
    parts = _header(summary) + _rollouts(summary) + _error(summary) + _memory(summary)
    return "\n".join(parts + (_real_models(summary) if real_models else []))


def format_comparison(plain: dict, package: dict) -> str:
    """The closing lines of a run of both routes: what crashed without the package, what it did."""
    lines = ["in short:"]
    error = plain["error"]
    if error and error["reentry_crash"]:
        lines.append(f"  without the package: train() crashed on rollout {error['rollout']} "
                     f"({error['type']}), the re-entry crash")
    elif error:
        lines.append(f"  without the package: rollout {error['rollout']} failed ({error['type']}), "
                     "which is not the re-entry crash")
    else:
        lines.append(f"  without the package: {plain['rollouts_completed']} rollouts, no crash")
    lines.append(f"  with it: {package['rollouts_completed']} / {package['config']['rollouts']} rollouts"
                 + (f", then {package['error']['type']} on rollout {package['error']['rollout']}" if package["error"] else ""))
    if plain["rollouts"] and package["rollouts"]:
        a, b = plain["rollouts"][0]["loss"], package["rollouts"][0]["loss"]
        lines.append(f"  rollout 1 loss: {a:.6f} on full logits, {b:.6f} from hidden states (the same computation)")
    return "\n".join(lines)
