"""The demo's summary as text: what ran, what crashed, what the package did, what it saves."""
from __future__ import annotations

from megatron_rl_patches.apps.presentation import human_bytes, text_table


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


def _trainable_build(t: dict) -> str:
    """What one trainable build of a teacher allocates beyond its weights, measured, with the formula."""
    per = t["trainable_build_bytes_per_teacher"]
    total = per["grad_buffer"] + per["optimizer_state"]
    formula = t["formula_bytes_per_teacher"]
    agrees = ("the `memory` formula gives the same" if formula == total
              else f"the `memory` formula: {human_bytes(formula)}")
    return (f"  one trainable build, measured (megatron-core DDP + Adam): {human_bytes(per['grad_buffer'])} grad "
            f"buffer + {human_bytes(per['optimizer_state'])} Adam m and v = {human_bytes(total)} ({agrees})")


def _memory(summary: dict) -> list[str]:
    cfg, t = summary["config"], summary["teachers"]
    models = f"{t['count']} teachers of {t['params_per_teacher']:,} parameters each"
    if summary["patches"]:
        lines = [f"{models}, built inference-only: grads and optimizer state they hold: "
                 f"{human_bytes(t['allocated_bytes'])}", _trainable_build(t),
                 f"  saved by the {t['count']} inference-only builds: {human_bytes(t['saved_bytes'])}"]
        residency = t.get("residency")
        if residency and residency["mode"] != "resident":
            how = {"stream": "streamed layer by layer", "swap": "swapped in whole"}[residency["mode"]]
            lines.append(f"  their weights live in host memory, {how}: at most "
                         f"{human_bytes(residency['peak_device_weight_bytes'])} on the device vs "
                         f"{human_bytes(residency['resident_weight_bytes'])} for resident builds")
    else:
        lines = [f"{models}, built trainable in DDP: grad buffers they hold: {human_bytes(t['allocated_bytes'])} "
                 "(an optimizer would add its state)", _trainable_build(t)]
    logits, watch = summary["logits_bytes_per_microbatch"], summary["vocab_wide_tensors"]
    tokens = cfg["micro_batch_size"] * cfg["seq_length"]
    shape = "x".join(map(str, watch["largest_shape"])) or "none"
    sizes = f"T = {tokens} tokens per micro-batch, V = {cfg['vocab_size']}, fp32"
    forwards = (f"{human_bytes(logits['one_forward'])} per forward x {2 + cfg['teachers']} forwards (the actor's "
                f"training and old-policy forwards, one per teacher) = {human_bytes(logits['total'])} per micro-batch")
    if summary["patches"]:
        lines.append(f"[T, V] logits never allocated ({sizes}): {forwards}")
        lines.append(f"  largest vocab-wide tensor allocated while scoring and training: a [{shape}] logits tile "
                     f"of {cfg['tile_rows']} rows, {human_bytes(watch['largest_bytes'])}")
    else:
        lines.append(f"[T, V] logits allocated ({sizes}): {forwards}")
    return lines


def _real_models(summary: dict) -> list[str]:
    real = summary["real_models"]
    n = summary["config"]["teachers"]
    rows = [[r["model"], f"{r['params']:,}", str(r["dp"]), "yes" if r["distributed_optimizer"] else "no",
             human_bytes(r["per_teacher_bytes"]), human_bytes(r["saved_bytes"])] for r in real["teachers"]]
    lines = [text_table(("model", "parameters", "DP", "dist. opt.", "per teacher", f"{n} teachers"), rows,
                        title="at real size, per GPU: training state inference-only teachers do not hold (fp32 "
                              "grads, fp32 main params, Adam m and v; bf16 weights not counted; "
                              "`megatron-rl-patches memory`) - for a loop that builds its teachers as "
                              "models of their own, as this demo does (upstream slime swaps teacher "
                              "weights into the actor instead and holds no such state)")]
    first = real["logits"][0]
    rows = [[r["model"], f"{r['vocab']:,} ({r['vocab_from']})", human_bytes(r["actor_logits_bytes"]),
             human_bytes(r["teacher_logits_bytes"]), human_bytes(r["fused_bytes_per_model"])] for r in real["logits"]]
    lines.append(text_table(
        ("model", "V (vocabulary of)", "actor logits", f"{n} teachers' logits", "fused outputs, per model"), rows,
        title=f"at real size, per micro-batch of {first['tokens']:,} tokens per GPU (TP = 1): the bf16 [T, V] logits "
              "the fused processors never allocate, and what they keep instead"))
    lines.append(f"  fused outputs: T x (k+1) fp32 values per model, the top-{first['topk']} log-probs and the "
                 "tail of each token (the same for any V)")
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
                 + (f", then {package['error']['type']} on rollout {package['error']['rollout']}"
                    if package["error"] else ""))
    if plain["rollouts"] and package["rollouts"]:
        a, b = plain["rollouts"][0]["loss"], package["rollouts"][0]["loss"]
        lines.append(f"  rollout 1 loss: {a:.6f} on full logits, {b:.6f} from hidden states (the same computation)")
    lines.extend(SLIME_LINES)
    return "\n".join(lines)


# What a slime user switches on for the same (docs/recipes.md, the slime section).
SLIME_LINES = (
    "  in slime: MEGATRON_RL_PATCHES=all (train_reentry, slime_logprobs, slime_fused: no logits in its "
    "forward steps, response rows only) - the logits savings above; the teachers' training-state "
    "savings only in forks that build a teacher role (upstream slime swaps teacher weights into the actor);",
    "    top-k multi-teacher OPD: MEGATRON_RL_PATCHES_OPD_TEACHERS=PATH,PATH plus --loss-type custom_loss "
    "--custom-loss-function-path megatron_rl_patches.integrations.slime_opd.topk_opd_policy_loss",
)
