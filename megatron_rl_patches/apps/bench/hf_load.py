"""Loading a Hugging Face checkpoint: time and peak host memory of `build_inference_model_from_hf`
against transformers' `from_pretrained` of the same checkpoint (every weight then touched, so
memory-mapped weights are really read) and a plain sequential read of its files, side by side.

A random float32 Qwen3-architecture checkpoint (~2.9 GB, 3 shards; 0.1 GB with --quick) is
written to a temporary folder and deleted afterwards. Each side runs in its own fresh process
(peak RSS is the process's high-water mark, taken from after its imports); the sides run
interleaved, 3 rounds (1 with --quick), page cache warm (the first plain read warms it): read the
best time per side and the ratios to transformers'.
"""
# lazy imports: import cost: torch and megatron-core load when a benchmark runs (in its case workers mostly)
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from megatron_rl_patches.apps.bench import outputs
from megatron_rl_patches.apps.bench.runner import run_cases

SIDES = ("plain read", "megatron-rl-patches", "transformers")
FULL = {"layers": 12, "hidden": 2048, "heads": 16, "kv_heads": 8, "ffn": 6144, "vocab": 32000, "shards": 3}
QUICK = {"layers": 2, "hidden": 512, "heads": 8, "kv_heads": 4, "ffn": 1536, "vocab": 8000, "shards": 2}
COLUMNS = ("side", "checkpoint_GB", "time_s", "vs_transformers", "peak_rss_GB", "above_start_GB",
           "above_checkpoint_GB", "note")
GB = 1e9
_TARGET = "megatron_rl_patches.apps.bench.hf_load"


def qwen3_config(plan: dict) -> dict[str, Any]:
    """config.json of the benchmark's Qwen3 (float32, untied output layer)."""
    return dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=plan["vocab"],
                hidden_size=plan["hidden"], intermediate_size=plan["ffn"], num_hidden_layers=plan["layers"],
                num_attention_heads=plan["heads"], num_key_value_heads=plan["kv_heads"], head_dim=128,
                tie_word_embeddings=False, max_position_embeddings=4096, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, hidden_act="silu",
                dtype="float32", attention_bias=False)


def write_case(probe: Any, root: str, plan: dict) -> dict:
    """Write the random checkpoint under `root`, one shard's tensors in memory at a time."""
    import torch
    from safetensors.torch import save_file  # lazy: optional dependency safetensors (the [hf] extra)

    from megatron_rl_patches.inference.loading.hf.families import architecture
    from megatron_rl_patches.inference.loading.hf.names import checkpoint_tensors

    config = qwen3_config(plan)
    shapes = checkpoint_tensors(architecture(config))
    names, shards = list(shapes), plan["shards"]
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for index in range(shards):
        file = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: torch.randn(shapes[name], generator=gen) * 0.02 + (1.0 if len(shapes[name]) == 1 else 0.0)
                for name in names[index::shards]}
        save_file(part, os.path.join(root, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
        del part
    Path(root, "config.json").write_text(json.dumps(config))
    Path(root, "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return {"bytes": sum(f.stat().st_size for f in Path(root).glob("*.safetensors"))}


def _lifetime_peak_rss() -> int:
    """The resident-set high-water mark (reset by the probe's start on Linux: the baseline plus the load's peak)."""
    import resource  # lazy: optional dependency resource: a POSIX-only standard module

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def _measured(probe: Any, load: Any) -> dict:
    probe.start()
    start = time.perf_counter()
    note = load()
    took = time.perf_counter() - start
    return {"time_s": took, "above_start": probe.peak(), "peak_rss": _lifetime_peak_rss(), "note": note or ""}


def read_case(probe: Any, root: str) -> dict:
    """Every file read start to end into one reused 16 MiB buffer."""
    def load() -> None:
        buffer = bytearray(16 << 20)
        for file in sorted(Path(root).glob("*.safetensors")):
            with open(file, "rb", buffering=0) as handle:
                while handle.readinto(buffer):
                    pass

    return _measured(probe, load)


def ours_case(probe: Any, root: str) -> dict:
    """build_inference_model_from_hf (1 rank, resident, CPU)."""
    import torch

    from megatron_rl_patches.inference import build_hf
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    with megatron_on_cpu():
        chunks: list = []
        result = _measured(probe, lambda: chunks.extend(build_hf.build_inference_model_from_hf(root)))
        result["params"] = sum(p.numel() for chunk in chunks for p in chunk.parameters())
        result["checksum"] = float(sum(p.double().sum() for chunk in chunks for p in chunk.parameters()))
        assert all(p.dtype is torch.float32 for chunk in chunks for p in chunk.parameters())
    return result


def transformers_case(probe: Any, root: str) -> dict:
    """AutoModelForCausalLM.from_pretrained (float32), then every weight summed in place (touched:
    weights still backed by the files' pages are read)."""
    import torch
    import transformers  # lazy: optional dependency transformers

    model: list = []

    def load() -> str:
        model.append(transformers.AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32))
        total = sum(float(p.sum()) for p in model[0].parameters())
        return f"transformers {transformers.__version__}; checksum {total:.6g}"

    return _measured(probe, load)


_CASES = {"plain read": read_case, "megatron-rl-patches": ours_case, "transformers": transformers_case}


def measure(plan: dict, rounds: int = 2, root: str | None = None) -> list[dict]:
    """One row per side: best time over `rounds` interleaved runs, the largest peaks."""
    folder = root or tempfile.mkdtemp(prefix="hf-load-bench-", dir="/tmp" if os.path.isdir("/tmp") else None)
    try:
        wrote = run_cases([{"target": f"{_TARGET}:write_case", "kwargs": {"root": folder, "plan": plan}}])[0]
        if wrote.get("error"):
            return [{"side": "write", "error": wrote["error"]}]
        runs: dict[str, list[dict]] = {side: [] for side in SIDES}
        order = [{"target": f"{_TARGET}:{_CASES[side].__name__}", "kwargs": {"root": folder}, "side": side}
                 for _ in range(rounds) for side in SIDES]
        for case, result in zip(order, run_cases(order, threads=2)):
            runs[case["side"]].append(result)
        return _rows(runs, wrote["bytes"])
    finally:
        if root is None:
            shutil.rmtree(folder, ignore_errors=True)


def _rows(runs: dict[str, list[dict]], checkpoint: int) -> list[dict]:
    rows = []
    for side, results in runs.items():
        errors = [r["error"] for r in results if r.get("error")]
        if errors:
            rows.append({"side": side, "error": errors[0], "note": f"error: {errors[0][:200]}"})
            continue
        rows.append({"side": side, "checkpoint_GB": checkpoint / GB, "time_s": min(r["time_s"] for r in results),
                     "peak_rss_GB": max(r["peak_rss"] for r in results) / GB,
                     "above_start_GB": max(r["above_start"] for r in results) / GB,
                     "above_checkpoint_GB": (max(r["above_start"] for r in results) - checkpoint) / GB,
                     "note": results[0]["note"]})
    reference = next((r["time_s"] for r in rows if r["side"] == "transformers" and "time_s" in r), None)
    for row in rows:
        row["vs_transformers"] = row["time_s"] / reference if reference and "time_s" in row else float("nan")
    return rows


def run(quick: bool = False, out_dir: str | None = None) -> list[dict]:
    rows = measure(QUICK if quick else FULL, rounds=1 if quick else 3)
    title = outputs.titled("Hugging Face checkpoint load: time and peak host RSS (float32 Qwen3, page cache warm)",
                           quick)
    outputs.print_table(rows, COLUMNS, title=title)
    if out_dir:
        outputs.write_tables(rows, COLUMNS, out_dir, "hf_load", title=title)
        good = [row for row in rows if "time_s" in row]
        if good:
            outputs.plot_grouped_bars(
                [dict(row, run="load") for row in good], os.path.join(out_dir, "hf_load.png"), group="side",
                series="run", values=["time_s", "above_start_GB"],
                titles=["time (s)", "peak RSS above the process's start (GB)"], suptitle=title)
    return rows
