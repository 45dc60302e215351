"""`megatron-rl-patches memory --head DIR [--head DIR2 ...] [--tp N]`: the bytes per rank of each
served teacher's output layer on the trainer (`TeacherHead.from_hf(DIR, tp_group)` at the student's
tensor-parallel size N): V_padded / N x H x the head's dtype, from config.json and the checkpoint's
tensor index alone (no weight is read). Beside --params / --hf the heads follow that plan's output
(a "teacher_heads" list in its JSON object)."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
from collections.abc import Callable
from typing import Any

from megatron_rl_patches.apps.cli._common import OK, UsageError
from megatron_rl_patches.apps.presentation import human_bytes, text_table


def head_row(path: str, tp: int, dtype: str | None) -> dict[str, Any]:
    """One head's plan at TP=`tp` (rank 0's shard: every shard has the same rows)."""
    # lazy: import cost: torch only once a head is planned (`memory`'s usage errors come before torch)
    import torch

    # lazy: import cost: the head's plan imports torch
    from megatron_rl_patches.teachers.head.teacher_head import MEGATRON_DIVISOR, HeadPlan

    try:  # padded as from_hf(tp_group=...) pads it: the student's layout, at TP=1 too
        plan = HeadPlan.of(path, dtype, MEGATRON_DIVISOR, tp, 0, fingerprinted=False)
    except (TypeError, ValueError, FileNotFoundError) as exc:
        raise UsageError(f"--head {path}: {exc}") from None
    element = torch.empty((), dtype=plan.dtype).element_size()
    return {"head": path, "tensor": plan.entry.name, "tp": tp, "vocab_size": plan.vocab_size,
            "padded_vocab_size": plan.padded, "rows_per_rank": plan.rows, "hidden_size": plan.hidden_size,
            "dtype": str(plan.dtype).removeprefix("torch."), "bytes_per_rank": plan.rows * plan.hidden_size * element}


def head_table(rows: list[dict[str, Any]]) -> str:
    table = text_table(("teacher head", "tensor", "TP", "rows per rank", "H", "dtype", "per rank"),
                       [[r["head"], r["tensor"], str(r["tp"]), f"{r['rows_per_rank']:,}", str(r["hidden_size"]),
                         r["dtype"], human_bytes(r["bytes_per_rank"])] for r in rows], numeric=True, rule=False)
    return table + ("\n\nper rank of the student's tensor-parallel group: the vocabulary padded as the student's "
                    "(a multiple of 128 x TP) and cut into TP shards of V_padded / TP rows x H")


def run_with_heads(args: argparse.Namespace, plan: Callable[[argparse.Namespace], int] | None) -> int:
    """The heads' rows alone (`plan` None), or after `plan(args)`'s output (its JSON object extended)."""
    rows = [head_row(path, args.tp or 1, args.head_dtype) for path in args.head]
    if plan is None:
        print(json.dumps({"teacher_heads": rows}, indent=2) if args.json else head_table(rows))
        return OK
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = plan(args)
    if args.json:
        print(json.dumps({**json.loads(printed.getvalue()), "teacher_heads": rows}, indent=2))
    else:
        print(printed.getvalue() + "\n" + head_table(rows))
    return code

