"""Top-k OPD loss: memory and time of ours vs a naive full-vocab autograd version, and the
tensor-parallel traffic of picking the top-k ids (k candidates per rank vs full rows).

Each case runs in a fresh process (peak memory is per case); the logits come from a small LM head
inside the measured region and only the loss keeps them alive, as in a real model.
"""
# lazy imports: import cost: torch and megatron-core load when a benchmark runs (in its case workers mostly)
from __future__ import annotations

import os
from typing import Any

from megatron_rl_patches.apps.bench import measure, outputs, runner

COLUMNS = ("T", "V", "k", "impl", "saved_MiB", "saved_per_U", "peak_MiB", "peak_per_U", "ms", "time_vs_naive", "note")
IMPLS = ("naive", "ours")
TEACHERS = 2
HIDDEN = 256


def _naive_loss(logits: Any, ids: Any, teacher_lp: Any, teacher_tail: Any) -> Any:
    """What a straightforward implementation does: full log-softmax kept for backward, the tail as
    log(1 - sum p_k), reverse KL against the uniform teacher mixture."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    top = logp.gather(-1, ids)
    tail = torch.log1p(-top.exp().sum(-1).clamp(max=1 - 1e-7))
    p_log = torch.cat([top, tail[:, None]], -1)
    q_log = torch.logsumexp(torch.cat([teacher_lp, teacher_tail[..., None]], -1), 0) - torch.log(
        torch.tensor(float(teacher_lp.shape[0]))
    )
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def case(probe: measure.MemoryProbe, *, impl: str, T: int, V: int, k: int, device: str = "cpu") -> dict:
    """One measurement (run in a fresh process by :func:`run`)."""
    import torch

    from megatron_rl_patches.ops.topk import topk_ids, topk_logprobs, topk_opd_loss

    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(T, HIDDEN, device=device, generator=gen)
    weight = (torch.randn(V, HIDDEN, device=device, generator=gen) * 0.05).requires_grad_()
    with torch.no_grad():
        teacher_logits = [hidden @ (weight * (1.0 + 0.1 * j)).T for j in range(TEACHERS)]
        ids = topk_ids(teacher_logits[0], k)
        pairs = [topk_logprobs(t, ids) for t in teacher_logits]
        teacher_lp = torch.stack([p[0] for p in pairs])
        teacher_tail = torch.stack([p[1] for p in pairs])
        del teacher_logits, pairs

    def loss_fn() -> Any:
        logits = hidden @ weight.T
        if impl == "naive":
            return _naive_loss(logits, ids, teacher_lp, teacher_tail).sum()
        return topk_opd_loss(logits, ids, teacher_lp, teacher_tail).sum()

    def step(_: Any = None) -> None:
        loss_fn().backward()
        weight.grad = None

    step()  # warm-up (allocator, kernels)
    with measure.SavedBytes(ignore=[hidden, weight]) as saved:
        loss = loss_fn()
    del loss
    probe.start()
    step()
    peak = probe.peak()
    seconds = measure.best_time(step, repeat=3, warmup=0)
    u = T * V * 4
    row = {"T": T, "V": V, "k": k, "impl": impl, "saved_MiB": saved.bytes / measure.MIB, "saved_per_U": saved.bytes / u,
           "peak_reset": probe.peak_reset, "ms": seconds * 1e3}
    if measure.memory_resolved(u, device):
        row.update(peak_MiB=peak / measure.MIB, peak_per_U=peak / u)
    else:  # saved-for-backward bytes are exact; the peak is not at this size
        row["note"] = measure.BELOW_RESOLUTION
    return row


def traffic_rows(k: int, V: int, tp_sizes: tuple[int, ...] = (2, 4, 8)) -> list[dict]:
    """Bytes per token all-gathered to pick the global top-k: k (value, id) candidates per rank
    vs gathering each rank's full fp32 vocab shard."""
    return [
        {"tp": tp, "V": V, "k": k, "ours_bytes_per_token": tp * k * (4 + 8), "full_rows_bytes_per_token": V * 4,
         "ratio": tp * k * 12 / (V * 4)}
        for tp in tp_sizes
    ]


def run(quick: bool = False, out_dir: str | None = None) -> list[dict]:
    """Print the table (and write topk.csv / topk.png / topk_traffic.csv into `out_dir`)."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = [(256, 4096, 8)] if quick else [(1024, 32000, 32), (4096, 32000, 32), (2048, 151936, 64)]
    cases = [
        {"target": f"{__name__}:case", "kwargs": {"impl": impl, "T": T, "V": V, "k": k, "device": device}}
        for T, V, k in shapes
        for impl in IMPLS
    ]
    rows = []
    for spec, result in zip(cases, runner.run_cases(cases)):
        rows.append({**spec["kwargs"], **result})
    for row in rows:
        naive = next((r for r in rows if r["impl"] == "naive" and r["T"] == row["T"] and r["V"] == row["V"]), None)
        if naive and "ms" in row and "ms" in naive:
            row["time_vs_naive"] = row["ms"] / naive["ms"]
    title = outputs.titled(f"top-k OPD loss, forward+backward ({device}, fp32, U = T*V*4 bytes)", quick)
    if quick:  # at T=256, V=4096 the fixed costs of the chunked pass dominate
        title += "\nat this shape ours can be slower than naive (fixed costs); the full run shows the real ratio"
    outputs.print_table(rows, COLUMNS, title=title)
    traffic = traffic_rows(k=shapes[-1][2], V=shapes[-1][1])
    outputs.print_table(traffic, list(traffic[0]), title="top-k id selection under TP: all-gathered bytes per token")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        outputs.write_csv(rows, os.path.join(out_dir, "topk.csv"))
        outputs.write_csv(traffic, os.path.join(out_dir, "topk_traffic.csv"))
        for row in rows:
            row["shape"] = f"T={row['T']} V={row['V']}"
        outputs.plot_grouped_bars(
            rows, os.path.join(out_dir, "topk.png"), group="shape", series="impl",
            values=["saved_per_U", "peak_per_U", "ms"],
            titles=["saved for backward / U", "peak / U", "fwd+bwd ms"], suptitle=title,
        )
    return rows
