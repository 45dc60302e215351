"""The ranks of `bench teacher-layout` (each a process of a spawned gloo world, the student at
TP=1 x DP=2 in parallel_state): the teacher built at each layout of `TPS` (its build watched by
the kit's FileReads: the checkpoint bytes this rank reads), then one micro-batch per rank scored
by each build in turn, round after round (interleaved, the order rotating), each step timed between two barriers and
its resident-set peak taken above the step's start (the kernel's high-water mark, reset first)."""
# lazy imports: import cost: the driver imports TPS and ranks; torch and the teacher load in the spawned ranks
from __future__ import annotations

import gc
import sys
import time
from typing import Any

from megatron_rl_patches.apps.bench.measure import MemoryProbe
from megatron_rl_patches.apps.quiet import hide_import_notes

# the teacher's tensor-parallel size per build: None is the student's own layout (layout=None:
# parallel_state's groups, TP=1 here: each rank holds the whole teacher, scores with the plain
# forward + log_probs_and_entropy); an int n is TeacherLayout(tp=n) through score_at_layout
TPS: tuple[int | None, ...] = (None, 1, 2)


def rows_of(rank: int, plan: dict) -> tuple[Any, Any]:
    """This rank's micro-batch: (tokens, labels) [rows, length], other ids on each rank."""
    import torch

    gen = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, plan["config"]["vocab_size"], (plan["rows"], plan["length"] + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _build(root: str, tp: int | None) -> list:
    import torch

    from megatron_rl_patches import build_inference_model_from_hf
    from megatron_rl_patches.inference import TeacherLayout

    layout = None if tp is None else TeacherLayout(tp=tp)
    return build_inference_model_from_hf(root, dtype=torch.float32, layout=layout)


def score_at_student_layout(chunks: list, tokens: Any, labels: Any) -> Any:
    """log p(labels) of this rank's rows by a teacher built in the student's TP=1 groups: the
    plain forward and log_probs_and_entropy on this rank's own rows (what score_at_layout does
    without the gather), [rows, length] fp32."""
    import torch

    from megatron_rl_patches.ops import log_probs_and_entropy

    model = chunks[0]
    rows, length = tokens.shape
    position_ids = torch.arange(length).expand(rows, length)
    causal = torch.ones(length, length, dtype=torch.bool).triu(1)[None, None].expand(rows, 1, length, length)
    with torch.no_grad():
        logits = model(tokens, position_ids, causal).reshape(rows * length, -1)
        log_probs, _ = log_probs_and_entropy(logits, labels.reshape(-1), vocab_size=model.hf_vocab_size)
    return log_probs.view(rows, length)


def _score(tp: int | None, chunks: list, tokens: Any, labels: Any) -> Any:
    from megatron_rl_patches.inference import score_at_layout

    if tp is None:
        return score_at_student_layout(chunks, tokens, labels)
    return score_at_layout(chunks, tokens, labels)


def _built(root: str, tp: int | None) -> tuple[list, dict]:
    """The build at `tp` and what it cost this rank: parameter bytes, checkpoint bytes read."""
    from megatron_rl_patches.testing.file_reads import FileReads

    with FileReads(root) as reads:
        chunks = _build(root, tp)
    checkpoint = sum(stop - begin for _, spans in reads.files.values() for begin, stop, _ in spans)
    return chunks, {
        "param_bytes": sum(p.numel() * p.element_size() for chunk in chunks for p in chunk.parameters()),
        "read_bytes": sum(int(flags.sum()) for flags in reads.read.values()),
        "checkpoint_bytes": checkpoint,
        "seconds": [], "peaks": [],
    }


def _step(tp: int | None, chunks: list, tokens: Any, labels: Any, probe: Any) -> tuple[float, int, Any]:
    """(seconds, resident-set peak above the step's start, scores) of one scoring step, timed
    from a barrier to a barrier (the world's step: it ends when the slowest rank's does)."""
    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    probe.start()
    start = time.perf_counter()
    scores = _score(tp, chunks, tokens, labels)
    dist.barrier()
    return time.perf_counter() - start, probe.peak(), scores


def _progress(rank: int, what: str) -> None:
    """A line on stderr from rank 0, so a long run shows how far it got."""
    if rank == 0:
        print(f"  {what} ({time.strftime('%H:%M:%S')})", file=sys.stderr, flush=True)


def ranks(rank: int, world_size: int, root: str, plan: dict) -> dict:
    """This rank's figures per build ({tp: {...}}): the build's bytes, the steps' seconds and
    peaks after a warm-up round, and the largest |difference| of its scores from the student's
    layout's."""
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    hide_import_notes()  # in each rank's process
    tokens, labels = rows_of(rank, plan)
    probe = MemoryProbe("cpu")
    with megatron_on_cpu():  # the student: TP=1 x DP=2
        builds, figures = {}, {}
        for tp in TPS:
            builds[tp], figures[tp] = _built(root, tp)
        _progress(rank, f"{len(TPS)} builds done")
        scores: dict = {}
        for round_index in range(plan["rounds"] + 1):  # the first round warms up
            shift = round_index % len(TPS)  # the order rotates: no build always runs first
            for tp in TPS[shift:] + TPS[:shift]:
                seconds, peak, scores[tp] = _step(tp, builds[tp], tokens, labels, probe)
                if round_index:
                    figures[tp]["seconds"].append(seconds)
                    figures[tp]["peaks"].append(peak)
            _progress(rank, f"round {round_index}/{plan['rounds']} done" + ("" if round_index else " (warm-up)"))
        for tp in TPS:
            figures[tp]["max_abs_diff"] = float((scores[tp] - scores[None]).abs().max())
            figures[tp]["peak_reset"] = probe.peak_reset
        del builds
    return figures
