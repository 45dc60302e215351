"""CPU seconds of the Hugging Face converter's steps, for /work/shared/tools/ab-bench (JSON on the
last line): tiny builds on CPU (three of each of five families: dense, MoE, MLA, Qwen3.5-MoE,
Qwen3-Next), every parameter's shard filled at TP 1 / 2 / 4 ten times, and `hf_memory_plan` on
every published fixture forty times. CPU time, not wall time: the machine is shared.

    python tools/hf_build_bench.py write DIR     # the tiny checkpoints, once
    ../shared/tools/ab-bench -n 7 REV_A REV_B -- .venv/bin/python tools/hf_build_bench.py DIR"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, transformers_layout, write_tiny_checkpoint

KINDS = ("qwen3", "qwen3_moe", "deepseek_v3", "qwen3_5_moe", "qwen3_next")


def fill_shards(arch, tensors, keys, numbers) -> None:
    from megatron_rl_patches.inference.loading.hf.convert import shard_pieces, source

    for size in (1, 2, 4) * 10:
        for key in keys:
            src = source(arch, key, numbers, 0)
            for rank in range(size):
                try:
                    shape, pieces = shard_pieces(arch, src, [tensors[n] for n in src.hf_names], rank, size, 1024)
                except ValueError:  # a size this tiny model does not divide
                    continue
                target = torch.empty(shape)
                for where, value in pieces:
                    if value is None:
                        where(target).zero_()
                    else:
                        where(target).copy_(value)


def main(root: Path) -> dict[str, float]:
    from safetensors.torch import load_file

    from megatron_rl_patches import build_inference_model_from_hf
    from megatron_rl_patches.inference.loading.hf import hf_memory_plan
    from megatron_rl_patches.inference.loading.hf.families import architecture
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    build = shard = 0.0
    with megatron_on_cpu():
        for kind in KINDS:
            for _ in range(3):
                start = time.process_time()
                chunk = build_inference_model_from_hf(root / kind, dtype=torch.float32)[0]
                build += time.process_time() - start
            numbers = {i: int(layer.layer_number) - 1 for i, layer in enumerate(chunk.decoder.layers)}
            keys = [key for key in chunk.state_dict() if not key.endswith("_extra_state")]
            tensors = load_file(root / kind / "model.safetensors")
            start = time.process_time()
            fill_shards(architecture(tiny_hf_config(kind)), tensors, keys, numbers)
            shard += time.process_time() - start
    fixtures = sorted((Path(os.environ.get("AB_SRC", ".")) / "tests/apps/cli/hf_configs").glob("*.json"))
    start = time.process_time()
    with tempfile.TemporaryDirectory() as tmp:
        for fixture in fixtures:
            (Path(tmp) / "config.json").write_text(fixture.read_text())
            for _ in range(40):
                hf_memory_plan(tmp, tp=2)
    return {"build_s": build, "shard_s": shard, "plan_s": time.process_time() - start}


if __name__ == "__main__":
    if sys.argv[1] == "write":
        for name in KINDS:
            write_tiny_checkpoint(Path(sys.argv[2]) / name, transformers_layout(tiny_hf_config(name)), seed=0)
    else:
        print(json.dumps(main(Path(sys.argv[1]))))
