"""Teacher residency: weight bytes on the device and time of one scoring rollout (micro-batches
of a frozen GPTModel, forward only) per mode: resident, swap (whole model in for the phase),
stream (per layer, per micro-batch) and stream + layer-major (`score_layer_major`: each piece
crosses the bus once per rollout).

Bytes come from the residency report (storage sizes: exact on CPU too); on CPU host and device
are the same memory, so the times show the bookkeeping, not the bus. On CUDA the copy time of a
mode (bytes moved / measured pinned host-to-device bandwidth) is set against the time it adds over
the resident build: `overlap` = copy time hidden / copy time. The modes run interleaved, one
rollout each per round: read the ratios of medians.
"""
# lazy imports: import cost: torch and megatron-core load when a benchmark runs (in its case workers mostly)
from __future__ import annotations

import functools
import os
import statistics
import time
from typing import Any

from megatron_rl_patches.apps.bench import outputs
from megatron_rl_patches.apps.bench.measure import best_time
from megatron_rl_patches.model.chunks import unwrap

MODES = ("resident", "swap", "stream", "stream + layer-major")
QUICK = {"layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seq": 16, "micro_batches": 3, "batch": 2}
FULL = {"layers": 8, "hidden": 256, "heads": 8, "vocab": 4096, "seq": 128, "micro_batches": 8, "batch": 2}
# the GPU goal (issue 31): >= 1B parameters, >= 64k tokens per rollout, bf16
GPU = {"layers": 20, "hidden": 2048, "heads": 16, "vocab": 32768, "seq": 4096, "micro_batches": 16, "batch": 1}
COLUMNS = ("mode", "device_weights_MiB", "vs_resident", "within_2_layers_head", "copies", "moved_MiB",
           "activations_MiB", "time_ms", "spread_ms", "time_vs_resident", "overlap", "note")
MIB = float(1 << 20)


def _config(plan: dict, cuda: bool) -> Any:
    import torch

    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config

    extra: dict[str, Any] = dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16) if cuda else {}
    return tiny_gpt_config(num_layers=plan["layers"], hidden_size=plan["hidden"],
                           num_attention_heads=plan["heads"], **extra)


def _batches(plan: dict, device: str) -> list[dict]:
    from megatron_rl_patches.testing.megatron_cpu import make_batch

    batches = []
    for seed in range(plan["micro_batches"]):
        batch = make_batch(plan["batch"], plan["seq"], plan["vocab"], seed=seed)
        batches.append({"input_ids": batch["tokens"].to(device), "position_ids": batch["position_ids"].to(device),
                        "attention_mask": batch["attention_mask"].to(device)})
    return batches


def _pieces_bytes(chunk: Any) -> tuple[int, int]:
    """(largest decoder layer, final norm + output layer) weight bytes."""
    model = unwrap(chunk)

    def nbytes(module: Any) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters()) if module is not None else 0

    norm = getattr(model.decoder, "final_layernorm", None) or getattr(model.decoder, "final_norm", None)
    return max(nbytes(layer) for layer in model.decoder.layers), nbytes(norm) + nbytes(model.output_layer)


def _rollout(mode: str, chunks: list, batches: list[dict]) -> Any:
    import torch

    from megatron_rl_patches.inference import on_device, score_layer_major

    if mode == "stream + layer-major":
        return score_layer_major(chunks, batches)
    with torch.no_grad(), on_device(chunks):  # swap: one phase; resident/stream: nothing held
        return [chunks[0](**batch) for batch in batches]


def _h2d_bytes_per_s(device: str) -> float | None:
    """Pinned host-to-device bandwidth (CUDA), None on CPU."""
    import torch

    if not device.startswith("cuda"):
        return None
    host = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    target = torch.empty_like(host, device=device)
    seconds = best_time(lambda: target.copy_(host, non_blocking=True), repeat=5,
                               sync=lambda: torch.cuda.synchronize(device))
    return host.numel() / seconds


def _timed(fn: Any, sync: Any) -> float:
    if sync:
        sync()
    start = time.perf_counter()
    fn()
    if sync:
        sync()
    return time.perf_counter() - start


def measure(plan: dict, device: str = "cpu", rounds: int = 5) -> list[dict]:
    """One row per mode (in this process): the modes' rollouts interleaved, one each per round
    after a warm-up round; the median time and its min-max spread."""
    import torch

    from megatron_rl_patches.inference import build_inference_model, residency_report
    from megatron_rl_patches.testing.megatron_cpu import megatron_world, tiny_gpt_provider

    cuda = device.startswith("cuda")
    rows = []
    with megatron_world(device):
        batches = _batches(plan, device)
        bandwidth = _h2d_bytes_per_s(device)
        sync = (lambda: torch.cuda.synchronize(device)) if cuda else None
        provider = tiny_gpt_provider(_config(plan, cuda), vocab_size=plan["vocab"], seq_length=plan["seq"])
        builds = {mode: build_inference_model(provider, residency=mode.split(" ")[0]) for mode in MODES}
        before = {mode: residency_report(chunks) for mode, chunks in builds.items()}
        samples: dict[str, list[float]] = {mode: [] for mode in MODES}
        for round_index in range(rounds + 1):
            for mode, chunks in builds.items():
                seconds = _timed(functools.partial(_rollout, mode, chunks, batches), sync)
                if round_index:  # the first round warms up
                    samples[mode].append(seconds)
        for mode, chunks in builds.items():
            report = residency_report(chunks)
            layer, head = _pieces_bytes(chunks[0])
            runs = rounds + 1
            rows.append({
                "mode": mode, "peak_device_weight_bytes": report.peak_device_weight_bytes,
                "resident_weight_bytes": report.resident_weight_bytes,
                "device_weights_MiB": report.peak_device_weight_bytes / MIB,
                "vs_resident": report.peak_device_weight_bytes / report.resident_weight_bytes,
                "within_2_layers_head": report.peak_device_weight_bytes <= 2 * layer + head,
                "copies": (report.copies - before[mode].copies) // runs,
                "moved_MiB": (report.bytes_moved - before[mode].bytes_moved) / runs / MIB,
                "activations_MiB": report.peak_activation_bytes / MIB,
                "time_ms": statistics.median(samples[mode]) * 1e3,
                "spread_ms": f"{min(samples[mode]) * 1e3:.0f}-{max(samples[mode]) * 1e3:.0f}",
                "bandwidth": bandwidth, "note": "",
            })
        del builds
    resident = rows[0]["time_ms"]
    for row in rows:
        row["time_vs_resident"] = row["time_ms"] / resident
        if row["bandwidth"]:
            copy_ms = row["moved_MiB"] * MIB / row["bandwidth"] * 1e3
            exposed = max(0.0, row["time_ms"] - resident)
            row["overlap"] = None if copy_ms == 0 else max(0.0, min(1.0, 1 - exposed / copy_ms))
        else:
            row["note"] = "CPU: host and device are one memory, times are bookkeeping"
    return rows


def run(quick: bool = False, out_dir: str | None = None, device: str | None = None) -> list[dict]:
    """Print the table; write residency.csv / .md / .png into `out_dir` when given."""
    started = time.perf_counter()  # the set-up (imports, megatron-core's world, the builds) counts
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    plan = QUICK if quick else (GPU if device.startswith("cuda") else FULL)
    rows = outputs.measured(lambda: measure(plan, device, rounds=1 if quick else 5), "mode")
    tokens = plan["micro_batches"] * plan["batch"] * plan["seq"]
    title = (f"teacher residency: one rollout of {plan['micro_batches']} micro-batches ({tokens} tokens), GPTModel "
             f"{plan['layers']} layers x {plan['hidden']} hidden, vocab {plan['vocab']}, {device}"
             f" ({time.perf_counter() - started:.0f} s from the benchmark's start, set-up included)"
             + (" [quick]" if quick else ""))
    outputs.print_table(rows, COLUMNS, title=title)
    if out_dir:
        outputs.write_tables(rows, COLUMNS, out_dir, "residency", title=title)
        if "error" not in rows[0]:
            outputs.plot_grouped_bars(  # one bar per mode
                [dict(row, build="one rollout") for row in rows], os.path.join(out_dir, "residency.png"), group="mode",
                series="build",
                values=["vs_resident", "time_vs_resident"],
                titles=["device weight bytes / resident",
                        "rollout time / resident" + ("\n(CPU: bookkeeping only, no copies to time)"
                                                     if not device.startswith("cuda") else "")],
                suptitle=title + ("\nOn CPU the times measure the package's bookkeeping, not host-device copies: "
                                  "time residency on a GPU (bench gpu)" if not device.startswith("cuda") else ""),
            )
    return rows
