"""`megatron-rl-patches memory --hf PATH`: a Hugging Face checkpoint's per-GPU weights at TP / PP /
EP by residency mode (from its config.json alone), and the training state a trainable build of
that shard would add (the table of `memory --params`)."""
from __future__ import annotations

import argparse
import json

from megatron_rl_patches.apps.cli._common import OK, UsageError
from megatron_rl_patches.apps.presentation import human_bytes, memory_report, modes_table
from megatron_rl_patches.inference.loading.hf.fp8 import fp8_disk_bytes
from megatron_rl_patches.inference.loading.hf.memory_plan import HFMemoryPlan, hf_memory_plan
from megatron_rl_patches.inference.sizing.memory import training_state_bytes


def plan_table(plan: HFMemoryPlan, chosen: str | None, fp8_bytes: int | None = None) -> str:
    """Per-GPU weights of the inference-only build by residency mode, the chosen one marked."""
    moe = f", {plan.active_params:,} active per token" if plan.active_params != plan.total_params else ""
    if plan.vision_params:
        moe += f" (text; the vision tower's {plan.vision_params:,} are not built)"
    fp8 = (f"; FP8 checkpoint: {fp8_bytes:,} bytes on disk ({human_bytes(fp8_bytes)}), built at "
           f"{plan.param_dtype}") if fp8_bytes else ""
    header = [
        f"{plan.source} ({plan.model_type}): {plan.total_params:,} parameters{moe}; vocab padded to "
        f"{plan.padded_vocab:,}{fp8}",
        f"Per GPU at TP={plan.tp} PP={plan.pp} EP={plan.ep} ({plan.param_dtype}): {plan.gpu_params:,} parameters "
        f"({plan.layers_per_stage} layers of {plan.layer_params:,}, embedding {plan.embedding_params:,} on the "
        f"first stage, output layer {plan.output_params:,} on the last), prefetch {plan.prefetch}",
    ]
    note = "per GPU of the pipeline stage holding the most; host bytes per data-parallel rank"
    return "\n".join([*header, "", modes_table(plan.modes, chosen), "", note])


def run_hf(args: argparse.Namespace) -> int:
    try:
        plan = hf_memory_plan(args.hf, tp=args.tp, pp=args.pp, ep=args.ep, param_dtype=args.param_dtype,
                              prefetch=args.prefetch)
        fp8_bytes = fp8_disk_bytes(args.hf)
        report = training_state_bytes(plan.gpu_params, dp=args.dp, distributed_optimizer=args.distributed_optimizer,
                                      param_dtype=args.param_dtype, grad_dtype=args.grad_dtype)
    except (TypeError, ValueError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps({**report.as_dict(), "residency": args.residency, "hf_plan": plan.as_dict(),
                          "fp8_disk_bytes": fp8_bytes}, indent=2))
    else:
        print(plan_table(plan, args.residency, fp8_bytes) + "\n\n" + memory_report(report))
    return OK
