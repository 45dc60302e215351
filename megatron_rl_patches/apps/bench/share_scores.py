"""`bench share-scores`: a step's served hidden states moved from the asking rank to its sharing
group, pickled (`broadcast_object_list`, what `TeacherStep.shared` did before) against
as tensors (`teachers.step.share_tensors.shared_results`: the layout, then one flat broadcast per
dtype), on a spawned gloo world of 2 CPU ranks.

The results: a head teacher's unprojected states, 32 samples of bf16 [rows, 4096] — 128 MiB (512
rows each) and 1 GiB (4096 rows each: 32 x 4k rows at H = 4096, the issue's size). Per row: the
time from a barrier to a barrier (the world's: the slowest rank's), the two ways interleaved one
each per round (the order alternating), after a warm-up round at the small size only (1 GiB: the
rounds are few and the first is kept); median and min-max spread, and `vs_pickled` = the median
over rounds of the time over the pickled way's in the same round. `peak_MiB`: the largest rank's
resident-set high-water mark during the move above its start (reset first; glibc's mmap threshold
fixed so freed pages leave the resident set), beside the states' own size. The receiving rank
checks its states bit for bit against the asking rank's on every round (their first and last
samples). --quick: 1 MiB, 2 rounds (the plumbing, not the figures)."""
# lazy imports: import cost: torch loads in the spawned ranks
from __future__ import annotations

import statistics
import time

from megatron_rl_patches.apps.bench import outputs
from megatron_rl_patches.apps.quiet import hide_import_notes

WORLD, SAMPLES, HIDDEN = 2, 32, 4096
FULL = {"sizes": [(512, 5, True), (4096, 3, False)]}  # (rows per sample, rounds, warm-up round)
QUICK = {"sizes": [(4, 2, True)]}
WAYS = ("pickled (broadcast_object_list)", "tensors (share_tensors)")
COLUMNS = ("states_MiB", "way", "time_ms", "spread_ms", "vs_pickled", "peak_MiB", "note")
MIB = float(1 << 20)
MMAP_THRESHOLD = str(128 << 10)


def states(rows: int, seed: int = 0) -> list:
    """The asking rank's results: SAMPLES bf16 states [rows, HIDDEN] (random, seeded)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, HIDDEN, generator=gen).bfloat16() for _ in range(SAMPLES)]


def pickled(served: dict | None, group: object) -> dict:
    """The old way: the asking rank's results pickled and broadcast as one object."""
    import torch.distributed as dist

    box = [served]
    dist.broadcast_object_list(box, src=0, group=group, device=None)
    return box[0]  # type: ignore[return-value]


def tensors(served: dict | None, group: object) -> dict:
    from megatron_rl_patches.teachers.step.share_tensors import shared_results

    return shared_results(served, group)


def one_move(way: int, served: dict | None, probe, expected_ends: tuple | None) -> tuple[float, int, bool]:
    """(seconds barrier to barrier, peak above start, received bit for bit) of one move."""
    import gc

    import torch
    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    probe.start()
    started = time.perf_counter()
    got = (pickled, tensors)[way](served, dist.group.WORLD)
    dist.barrier()
    seconds, peak = time.perf_counter() - started, probe.peak()
    same = True
    if expected_ends is not None:
        first, last = got[0][0], got[0][-1]
        same = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip((first, last), expected_ends))
    del got
    return seconds, peak, same


def ranks(rank: int, world_size: int, plan: dict) -> list[dict]:
    """This rank's figures per size: per way the rounds' seconds, peaks and bit-for-bit checks."""
    from megatron_rl_patches.apps.bench.measure import MemoryProbe

    hide_import_notes()
    probe = MemoryProbe("cpu")
    out = []
    for rows, rounds, warm in plan["sizes"]:
        made = states(rows)
        ends = (made[0], made[-1])
        served = {0: made} if rank == 0 else None
        if rank != 0:
            del made
        figures: dict = {way: {"seconds": [], "peaks": [], "same": []} for way in range(len(WAYS))}
        for round_index in range(rounds + (1 if warm else 0)):
            order = (0, 1) if round_index % 2 == 0 else (1, 0)
            for way in order:
                seconds, peak, same = one_move(way, served, probe, None if rank == 0 else ends)
                if round_index or not warm:
                    figures[way]["seconds"].append(seconds)
                    figures[way]["peaks"].append(peak)
                    figures[way]["same"].append(same)
        out.append({"rows": rows, "bytes": SAMPLES * rows * HIDDEN * 2, "figures": figures,
                    "peak_reset": probe.peak_reset})
        del served, ends
    return out


def measure(plan: dict) -> list[list[dict]]:
    from megatron_rl_patches.testing.environ import environment
    from megatron_rl_patches.testing.multirank import run_multirank

    with environment({"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}):  # read by glibc when each spawned rank starts
        return run_multirank(ranks, WORLD, plan, timeout=1800, start_method="spawn")


def rows_of(per_rank: list[list[dict]], quick: bool) -> list[dict]:
    rows = []
    for size_index, size in enumerate(per_rank[0]):
        moves = [[max(times) for times in zip(*(r[size_index]["figures"][way]["seconds"] for r in per_rank))]
                 for way in range(len(WAYS))]
        for way, name in enumerate(WAYS):
            peaks = [max(r[size_index]["figures"][way]["peaks"]) for r in per_rank]
            same = all(all(r[size_index]["figures"][way]["same"]) for r in per_rank)
            resolved = not quick and all(r[size_index]["peak_reset"] for r in per_rank)
            rows.append({
                "states_MiB": size["bytes"] / MIB, "way": name, "time_ms": statistics.median(moves[way]) * 1e3,
                "spread_ms": f"{min(moves[way]) * 1e3:.0f}-{max(moves[way]) * 1e3:.0f}",
                "vs_pickled": statistics.median(t / p for t, p in zip(moves[way], moves[0])),
                "peak_MiB": max(peaks) / MIB if resolved else None,
                "peak_MiB_by_rank": [p / MIB for p in peaks], "rounds": len(moves[way]),
                "note": ("" if same else "RECEIVED STATES DIFFER; ")
                + ("" if resolved else "peak not measured (--quick, or no peak reset on this OS)"),
            })
    return rows


def run(quick: bool = False, out_dir: str | None = None) -> list[dict]:
    """Print the table; write share_scores.csv / .md / .png into `out_dir` when given."""
    started = time.perf_counter()
    hide_import_notes()
    plan = QUICK if quick else FULL
    rows = outputs.measured(lambda: rows_of(measure(plan), quick), "way")
    title = outputs.titled(
        f"a step's served bf16 hidden states shared by the asking rank ({SAMPLES} samples x rows x {HIDDEN}), "
        f"{WORLD} gloo CPU ranks,\npickled vs as tensors, interleaved rounds ({time.perf_counter() - started:.0f} s "
        f"from the benchmark's start)", quick)

    def plot(rows: list[dict], path: str) -> None:
        outputs.plot_grouped_bars([dict(row, size=f"{row['states_MiB']:.0f} MiB") for row in rows], path,
                                  group="size", series="way", values=["time_ms", "vs_pickled", "peak_MiB"],
                                  titles=["time (ms)", "time / pickled", "peak per rank (MiB)"], suptitle=title)

    return outputs.reported(rows, COLUMNS, title, out_dir, "share_scores", plot)
