"""`bench self-teacher`'s memory rows: verl's live self-teacher pass (`integrations.verl.self_teacher
.scored_rows`, TP = 1) at a shape where the logits dominate, before and after issue 99: the logits
route it took before (the model's logits of each privileged sequence, their response rows [R, V]
in float64, the top-k ops on them: what `SelfTeacher` took then) against today's (the final hidden
states through `hidden_output_processor`, the output layer's weight, the fused head's vocabulary
tiles). Peak bytes the ops allocate on CPU (`allocated.AllocatedPeak`: exact, the weights not
counted), beside the [R, V] float32 term the logits would take."""
# lazy imports: import cost: torch and megatron-core load when the benchmark runs
from __future__ import annotations

from typing import Any

from megatron_rl_patches.apps.bench.measure import MIB
from megatron_rl_patches.ops.scoring_plan import ScoringPlan

FULL: dict[str, Any] = {"layers": 1, "hidden": 64, "heads": 4, "vocab": 32768, "context": 64, "response": 1024,
                        "top_k": 16}
QUICK: dict[str, Any] = {"layers": 1, "hidden": 32, "heads": 4, "vocab": 8192, "context": 16, "response": 1024,
                         "top_k": 4}
ROUTES = {"logits": "before: the model's logits, [R, V] float64", "fused": "after: hidden states + fused head"}
COLUMNS = ("route", "R", "V", "logits_RV_MiB", "peak_MiB", "largest_MiB", "peak_vs_logits", "max_abs_diff")


def logits_route(model: Any, privileged: Any, vocab: int, scoring: ScoringPlan) -> tuple[Any, Any]:
    """The pass as it was: each sequence's logits, the response rows cut to the real vocabulary and
    made float64, `topk_ids` then `topk_logprobs` (the token's log-prob beside, as `SelfTeacher` did)."""
    import torch

    from megatron_rl_patches.ops.topk import topk_ids, topk_logprobs

    rows = []
    for sequence, start in zip(privileged.sequences, privileged.response_starts):
        width = len(sequence)
        causal = torch.ones(width, width, dtype=torch.bool).tril().logical_not()[None, None]
        rows.append(model(sequence[None], torch.arange(width)[None], causal)[0, start - 1:width - 1].float())
    every = torch.cat([one[:, :vocab] for one in rows]).double()
    tokens = torch.cat([s[start:] for s, start in zip(privileged.sequences, privileged.response_starts)]).long()
    ids = topk_ids(every, scoring.k)
    values, _ = topk_logprobs(every, ids)
    topk_logprobs(every, tokens[:, None])
    return ids, values


def measure(plan: dict, scoring: ScoringPlan) -> list[dict]:
    """Both routes on one GPTModel (float32, CPU) and one privileged sequence of context + response,
    at `scoring` (the bench's K at temperature 1, made at its door)."""
    import torch

    import megatron_rl_patches
    from megatron_rl_patches.apps.bench.allocated import AllocatedPeak
    from megatron_rl_patches.integrations.verl.self_teacher import scored_rows
    from megatron_rl_patches.teachers import TeacherBatch
    from megatron_rl_patches.testing.megatron_cpu import build_tiny_gpt, megatron_world, tiny_gpt_config

    vocab, rows = plan["vocab"], plan["response"]
    gen = torch.Generator().manual_seed(0)
    privileged = TeacherBatch([torch.randint(0, vocab, (plan["context"] + rows,), generator=gen)], [plan["context"]])
    out = []
    with megatron_world("cpu"):
        config = tiny_gpt_config(num_layers=plan["layers"], hidden_size=plan["hidden"],
                                 num_attention_heads=plan["heads"])
        model = build_tiny_gpt(config, vocab_size=vocab, seq_length=plan["context"] + rows, seed=0).eval()
        megatron_rl_patches.apply(only="gpt_output_processor")  # megatron-core < 0.18: its output_processor= hook
        try:
            with torch.no_grad():
                results = {}
                for route in ROUTES:
                    with AllocatedPeak() as seen:
                        if route == "logits":
                            ids, values = logits_route(model, privileged, vocab, scoring)
                        else:
                            ((ids, values),) = scored_rows(model, model, None, vocab, scoring, "hint", privileged)
                    results[route] = (seen, values.double())
        finally:
            megatron_rl_patches.revert()
    logits_bytes = rows * vocab * 4
    for route, label in ROUTES.items():
        seen, values = results[route]
        out.append({"route": label, "R": rows, "V": vocab, "logits_RV_MiB": logits_bytes / MIB,
                    "peak_MiB": seen.peak / MIB, "largest_MiB": seen.largest / MIB,
                    "peak_vs_logits": seen.peak / logits_bytes,
                    "max_abs_diff": float((values - results["logits"][1]).abs().max())})
    return out


def run(quick: bool = False, out_dir: str | None = None) -> list[dict]:
    """Print the table; write self_teacher_pass.csv / .md into `out_dir` when given."""
    from megatron_rl_patches.apps.bench import outputs

    plan = QUICK if quick else FULL
    title = outputs.titled(
        f"verl's live self-teacher pass, TP = 1: GPTModel {plan['layers']} layer x {plan['hidden']} hidden, vocab "
        f"{plan['vocab']}, fp32 CPU, top-{plan['top_k']}; one privileged sequence of context {plan['context']} + "
        f"response {plan['response']}; peak bytes the ops allocate (weights not counted)", quick)
    try:
        rows = measure(plan, ScoringPlan(plan["top_k"]))  # K checked once, here: the routes take the plan
    except Exception as exc:  # one row saying why, as the other benchmarks do (in the column this table shows)
        rows = [{"route": "all", "error": f"{type(exc).__name__}: {exc}", "max_abs_diff": f"error: {exc}"[:300]}]
    return outputs.reported(rows, COLUMNS, title, out_dir, "self_teacher_pass")
