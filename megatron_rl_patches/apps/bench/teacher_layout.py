"""`bench teacher-layout`: a Hugging Face teacher at the student's layout against the same teacher
at its own tensor-parallel layout, on a spawned gloo world of 2 CPU ranks (the student at TP=1 x
DP=2). Rows: the student's layout (layout=None: every rank holds the whole teacher and scores its
own rows), TeacherLayout(tp=1) (the layout's machinery at the same split: the gather and
score_at_layout over groups of one) and TeacherLayout(tp=2) (each rank holds half the teacher;
the two ranks' rows are gathered and scored together).

Per row: the step time of scoring one micro-batch per rank (log-probs of its labels), timed from
a barrier to a barrier, the builds interleaved one step each per round (the order rotating from
round to round) after a warm-up round: median and min-max spread over the rounds, and
`vs_student` = the median over rounds of the step time over the student's layout's in the same
round. Per rank: the teacher's parameter bytes
(exact: the sum of this rank's parameter sizes; on CPU the device is host memory), the checkpoint
bytes its build read (the kit's FileReads: the bytes of the safetensors files that torch calls
read through their memory maps) and the step's peak: the rank's resident-set high-water mark
(reset before the step, Linux) above the resident set at its start, with glibc's mmap threshold
fixed (every tensor's pages go back to the system when freed, so one step's freed memory does not
hide the next one's). The largest of the two ranks is shown. `max_abs_diff`: the largest
|difference| of the scores from the student's layout's (the row-parallel sums run in another
order at tp=2: a few fp32 ulps).

The teacher: a random float32 Qwen3 written with the kit (4 layers, hidden 256, 8 / 4 heads of 32,
MLP 768, vocab 32000, untied); 4 rows x 1024 tokens per rank (T = 4096). --quick: the kit's tiny
Qwen3 and 2 rows x 16 tokens (the plumbing, not the figures).
"""
# lazy imports: import cost: torch and megatron-core load when a benchmark runs (in its case workers mostly)
from __future__ import annotations

import os
import statistics
import tempfile
import time

from megatron_rl_patches.apps.bench import outputs
from megatron_rl_patches.apps.bench.teacher_layout_ranks import TPS, ranks
from megatron_rl_patches.apps.quiet import hide_import_notes
from megatron_rl_patches.testing.environ import environment

WORLD = 2
FULL = {"config": dict(vocab_size=32000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=1024),
        "rows": 4, "length": 1024, "rounds": 5}
QUICK = {"config": dict(vocab_size=1001), "rows": 2, "length": 16, "rounds": 2}
STUDENT = "student's layout (layout=None)"
COLUMNS = ("layout", "step_ms", "spread_ms", "vs_student", "weights_MiB", "weights_share", "read_MiB", "read_share",
           "step_peak_MiB", "max_abs_diff", "note")
MIB = float(1 << 20)
# glibc's mmap threshold, fixed in the ranks: a freed tensor's pages leave the resident set
MMAP_THRESHOLD = str(128 << 10)


def label(tp: int | None) -> str:
    return STUDENT if tp is None else f"TeacherLayout(tp={tp})"


def measure(plan: dict) -> list[dict]:
    """Each rank's figures per build (teacher_layout_ranks.ranks), over a checkpoint written to a
    temporary folder (deleted after)."""
    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint
    from megatron_rl_patches.testing.multirank import run_multirank

    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "qwen3")
        write_tiny_checkpoint(root, tiny_hf_config("qwen3", **plan["config"]), seed=0)
        with environment({"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}):  # glibc reads it as each process starts
            # spawned, not forked from a server: glibc reads the threshold when a process starts
            return run_multirank(ranks, WORLD, root, plan, timeout=1800, start_method="spawn")


def _row(tp: int | None, per_rank: list[dict], quick: bool) -> dict:
    figures = [rank[tp] for rank in per_rank]
    student = [rank[None] for rank in per_rank]
    # a round's step is the world's: from a barrier to a barrier, the slowest rank's time
    steps = [max(times) for times in zip(*(f["seconds"] for f in figures))]
    student_steps = [max(times) for times in zip(*(f["seconds"] for f in student))]
    weights = max(f["param_bytes"] for f in figures)
    read = max(f["read_bytes"] for f in figures)
    checkpoint = figures[0]["checkpoint_bytes"]
    peaks = [max(f["peaks"]) for f in figures]
    resolved = not quick and all(f["peak_reset"] for f in figures)
    return {
        "layout": label(tp), "tp": tp, "step_ms": statistics.median(steps) * 1e3,
        "spread_ms": f"{min(steps) * 1e3:.0f}-{max(steps) * 1e3:.0f}",
        "vs_student": statistics.median(s / b for s, b in zip(steps, student_steps)),
        "weights_MiB": weights / MIB, "weights_share": weights / max(f["param_bytes"] for f in student),
        "weights_bytes_by_rank": [f["param_bytes"] for f in figures],
        "read_MiB": read / MIB, "read_share": read / checkpoint,
        "read_bytes_by_rank": [f["read_bytes"] for f in figures], "checkpoint_bytes": checkpoint,
        "step_peak_MiB": max(peaks) / MIB if resolved else None,
        "max_abs_diff": max(f["max_abs_diff"] for f in figures),
        "note": "" if resolved else "peak not measured (--quick: below RSS resolution; or no peak reset on this OS)",
    }


def rows_of(per_rank: list[dict], quick: bool) -> list[dict]:
    return [_row(tp, per_rank, quick) for tp in TPS]


def _title(plan: dict, quick: bool, seconds: float) -> str:
    config = {"vocab_size": 1001, "hidden_size": 32, "num_hidden_layers": 2, **plan["config"]}
    tokens = plan["rows"] * plan["length"]
    return outputs.titled(
        f"teacher layout: one micro-batch per rank scored ({plan['rows']} x {plan['length']} = {tokens} tokens per "
        f"rank), Qwen3 {config['num_hidden_layers']} layers x {config['hidden_size']} hidden, vocab "
        f"{config['vocab_size']}, fp32,\n{WORLD} gloo CPU ranks (student TP=1 x DP={WORLD}), {plan['rounds']} "
        f"interleaved rounds ({seconds:.0f} s from the benchmark's start)", quick)


def _plot(rows: list[dict], path: str, title: str) -> None:
    panels = [("vs_student", "step time / student's layout"), ("weights_MiB", "teacher bytes per rank (MiB)"),
              ("read_MiB", "checkpoint bytes read per rank (MiB)"), ("step_peak_MiB", "step peak per rank (MiB)")]
    outputs.plot_grouped_bars([dict(row, world=f"{WORLD} ranks") for row in rows],
                              path, group="layout", series="world",
                              values=[value for value, _ in panels], titles=[title for _, title in panels],
                              suptitle=title)


def run(quick: bool = False, out_dir: str | None = None) -> list[dict]:
    """Print the table; write teacher_layout.csv / .md / .png into `out_dir` when given."""
    started = time.perf_counter()
    hide_import_notes()
    plan = QUICK if quick else FULL

    def scored() -> list[dict]:
        from megatron_rl_patches.inference.teacher_layout.groups import process_group_collection_class

        process_group_collection_class()  # a megatron-core without it is refused here, before the spawn
        return rows_of(measure(plan), quick)

    rows = outputs.measured(scored, "layout")
    title = _title(plan, quick, time.perf_counter() - started)
    return outputs.reported(rows, COLUMNS, title, out_dir, "teacher_layout",
                            lambda rows, path: _plot(rows, path, title))

