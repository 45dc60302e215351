"""`megatron-rl-patches memory --hf PATH --teacher-tp N`: a Hugging Face teacher at its own
tensor-parallel layout over the student's ranks (world = the student's --tp x --pp x --dp; the
teacher's data-parallel size follows), beside the same teacher built at the student's layout:
per-GPU bytes and host bytes per rank of each. Only what the builder serves at a layout is planned
(resident; no teacher pipeline / expert parallelism; every family, experts split over the teacher's
tensor-parallel group): the rest is refused with the builder's own words."""
from __future__ import annotations

import argparse
import json
from typing import Any

from megatron_rl_patches.apps.cli._common import OK, UsageError
from megatron_rl_patches.apps.presentation import human_bytes, text_table
from megatron_rl_patches.inference.loading.hf.memory_plan import HFMemoryPlan, hf_memory_plan


def _checked(args: argparse.Namespace) -> int:
    """The student's world size, once the teacher's sizes are ones a layout serves (UsageError)."""
    for flag in ("--teacher-pp", "--teacher-ep"):
        if getattr(args, flag[2:].replace("-", "_")) > 1:
            kind = "pipeline" if flag == "--teacher-pp" else "expert"
            raise UsageError(f"{flag} {getattr(args, flag[2:].replace('-', '_'))}: a teacher's own {kind}-parallel "
                             "size is not served yet (tensor parallelism is: --teacher-tp N); drop it or use 1")
    if args.residency not in (None, "resident"):
        raise UsageError(f"--residency {args.residency} with --teacher-tp: a teacher at its own layout is served "
                         "resident only; drop --residency (or --teacher-tp, to plan it at the student's layout)")
    world = args.tp * args.pp * args.dp
    if world % args.teacher_tp:
        raise UsageError(f"--teacher-tp {args.teacher_tp} cannot be laid over the student's {world} rank(s) (--tp "
                         f"{args.tp} x --pp {args.pp} x --dp {args.dp}): choose a --teacher-tp that divides {world}")
    return world


def _row(name: str, plan: HFMemoryPlan, mode: str) -> dict[str, Any]:
    bytes_ = plan.mode(mode)
    return {"layout": name, "tp": plan.tp, "pp": plan.pp, "ep": plan.ep, "residency": mode,
            "gpu_bytes": bytes_.device_peak, "host_bytes_per_rank": bytes_.host}


def run_teacher(args: argparse.Namespace) -> int:
    from megatron_rl_patches.inference.loading.hf.families import read_architecture
    from megatron_rl_patches.inference.teacher_layout.build_args import refuse_unserved
    from megatron_rl_patches.inference.teacher_layout.layout import TeacherLayout

    world = _checked(args)
    try:
        layout = TeacherLayout(tp=args.teacher_tp)
        refuse_unserved(layout, read_architecture(args.hf, sizing=True), "resident", "builtin")
        own = hf_memory_plan(args.hf, tp=args.teacher_tp, param_dtype=args.param_dtype)
        student = hf_memory_plan(args.hf, tp=args.tp, pp=args.pp, ep=args.ep, param_dtype=args.param_dtype,
                                 prefetch=args.prefetch)
    except (TypeError, ValueError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from None
    rows = [_row(f"own (TP={args.teacher_tp} x DP={world // args.teacher_tp})", own, "resident"),
            *(_row("student's", student, mode) for mode in ("resident", "swap", "stream"))]
    if args.json:
        print(json.dumps({"world": world, "teacher_tp": args.teacher_tp, "teacher_dp": world // args.teacher_tp,
                          "layouts": rows, "hf_plan": own.as_dict()}, indent=2))
        return OK
    header = (f"{own.source} ({own.model_type}): {own.total_params:,} parameters; the teacher over the student's "
              f"{world} rank(s) (--tp {args.tp} x --pp {args.pp} x --dp {args.dp}), {own.param_dtype}")
    table = text_table(("teacher layout", "TP", "residency", "per GPU", "host per rank"),
                       [[r["layout"], str(r["tp"]), r["residency"], human_bytes(r["gpu_bytes"]),
                         human_bytes(r["host_bytes_per_rank"])] for r in rows], numeric=True, rule=False)
    note = ("per GPU of the pipeline stage holding the most; at its own layout each rank reads 1/TP of the "
            "teacher's bytes (the norms whole)")
    print("\n".join([header, "", table, "", note]))
    return OK
