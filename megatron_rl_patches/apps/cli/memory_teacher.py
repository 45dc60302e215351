"""`megatron-rl-patches memory --hf PATH --teacher-tp N [--teacher-pp M]`: a Hugging Face teacher
at its own tensor / pipeline-parallel layout over the student's ranks (world = the student's --tp
x --pp x --dp; the teacher's data-parallel size follows), beside the same teacher built at the
student's layout: per-GPU bytes and host bytes per rank of each, resident, swap and stream (a
swap / stream teacher at its own layout keeps its own shard in host memory; `--residency MODE`
marks the mode a run uses). Only what the builder serves at a layout is planned (no teacher expert
parallelism; every family at any --teacher-tp x --teacher-pp its layers divide, experts split
over the teacher's tensor-parallel group): the rest is refused with the builder's own words."""
from __future__ import annotations

import argparse
import json
from typing import Any

from megatron_rl_patches.apps.cli._common import OK, UsageError
from megatron_rl_patches.apps.presentation import human_bytes, text_table
from megatron_rl_patches.inference.loading.hf.families import read_architecture
from megatron_rl_patches.inference.loading.hf.memory_plan import HFMemoryPlan, hf_memory_plan
from megatron_rl_patches.inference.teacher_layout.build_args import refuse_unserved
from megatron_rl_patches.inference.teacher_layout.layout import TeacherLayout
from megatron_rl_patches.settings import RESIDENCY_MODES


def _checked(args: argparse.Namespace) -> int:
    """The student's world size, once the teacher's sizes are ones a layout serves (UsageError)."""
    if args.teacher_ep > 1:
        raise UsageError(f"--teacher-ep {args.teacher_ep}: a teacher's own expert-parallel size is not served yet "
                         "(tensor and pipeline parallelism are: --teacher-tp N --teacher-pp M); drop it or use 1")
    world = args.tp * args.pp * args.dp
    if world % (args.teacher_tp * args.teacher_pp):
        pipeline = f" x --teacher-pp {args.teacher_pp}" if args.teacher_pp > 1 else ""
        sizes = f"--teacher-tp {args.teacher_tp}{pipeline}"
        raise UsageError(f"{sizes} cannot be laid over the student's {world} rank(s) (--tp {args.tp} x --pp "
                         f"{args.pp} x --dp {args.dp}): choose teacher sizes whose product divides {world}")
    return world


def _row(name: str, plan: HFMemoryPlan, mode: str, chosen: str | None) -> dict[str, Any]:
    bytes_ = plan.mode(mode)
    return {"layout": name, "tp": plan.tp, "pp": plan.pp, "ep": plan.ep, "residency": mode,
            "gpu_bytes": bytes_.device_peak, "host_bytes_per_rank": bytes_.host, "chosen": mode == chosen}


def run_teacher(args: argparse.Namespace) -> int:
    world = _checked(args)
    tp, pp = args.teacher_tp, args.teacher_pp
    try:
        layout = TeacherLayout(tp=tp, pp=pp)
        arch = read_architecture(args.hf, sizing=True)
        refuse_unserved(layout, arch, "builtin")
        own = hf_memory_plan(args.hf, tp=tp, pp=pp, param_dtype=args.param_dtype, prefetch=args.prefetch)
        student = hf_memory_plan(args.hf, tp=args.tp, pp=args.pp, ep=args.ep, param_dtype=args.param_dtype,
                                 prefetch=args.prefetch)
    except (TypeError, ValueError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from None
    dp = world // (tp * pp)
    name = f"own (TP={tp}" + (f" x PP={pp}" if pp > 1 else "") + f" x DP={dp})"
    # the own layout's rows first (resident, swap, stream), then the student's; --residency marks its mode's
    rows = [*(_row(name, own, mode, args.residency) for mode in RESIDENCY_MODES),
            *(_row("student's", student, mode, args.residency) for mode in RESIDENCY_MODES)]
    if args.json:
        print(json.dumps({"world": world, "teacher_tp": tp, "teacher_pp": pp, "teacher_dp": dp,
                          "residency": args.residency, "layouts": rows, "hf_plan": own.as_dict()}, indent=2))
        return OK
    header = (f"{own.source} ({own.model_type}): {own.total_params:,} parameters; the teacher over the student's "
              f"{world} rank(s) (--tp {args.tp} x --pp {args.pp} x --dp {args.dp}), {own.param_dtype}")
    table = text_table(("teacher layout", "TP", "PP", "residency", "per GPU", "host per rank"),
                       [[r["layout"], str(r["tp"]), str(r["pp"]), ("* " if r["chosen"] else "  ") + r["residency"],
                         human_bytes(r["gpu_bytes"]),
                         human_bytes(r["host_bytes_per_rank"])] for r in rows], numeric=True, rule=False)
    note = ("per GPU of the pipeline stage holding the most; at its own layout each rank reads 1/TP of its "
            "stage's bytes (the norms whole), a stage 1/PP of the layers, and swap / stream keep that shard in "
            "host memory")
    print("\n".join([header, "", table, "", note]))
    return OK
