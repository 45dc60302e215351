"""Peak host memory of a Hugging Face build above the built model stays about one tensor: a
checkpoint with one big tensor (the tied embedding, 16 MiB) among ~90 MiB of small ones, built
in a fresh process whose resident-set high-water mark is read; negative control: the same build
with the reader never releasing a file's map (every tensor kept mapped) is seen above the bound."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint

pytestmark = [pytest.mark.megatron]

MIB = 1 << 20

# one build per fresh process (freed memory a process keeps would hide a second build's): as the
# loader is ("ours"), or with the reader's budget unbounded ("kept": its maps never re-opened)
_SCRIPT = """
import json, sys, torch
from megatron_rl_patches import build_inference_model_from_hf
from megatron_rl_patches.apps.bench.measure import MemoryProbe
from megatron_rl_patches.inference.loading.hf import files
from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

def build():
    probe = MemoryProbe()
    probe.start()
    chunks = build_inference_model_from_hf(sys.argv[1], dtype=torch.float32)
    peak = probe.peak()
    model = sum(p.numel() * p.element_size() for chunk in chunks for p in chunk.parameters())
    return {"above_model": peak - model, "model": model, "reset": probe.peak_reset}

if sys.argv[2] == "kept":
    keep_all = files.TensorReader.__init__
    files.TensorReader.__init__ = lambda self, index, budget=None: keep_all(self, index, budget=1 << 62)
with megatron_on_cpu():
    print(json.dumps(build()))
"""


def test_peak_host_memory_above_the_model_is_about_one_tensor(tmp_path):
    config = tiny_hf_config("qwen3", vocab_size=16384, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=64, intermediate_size=1024, num_hidden_layers=24, tie_word_embeddings=True)
    tensors = write_tiny_checkpoint(tmp_path, config)
    sizes = sorted(t.numel() * t.element_size() for t in tensors.values())
    big, rest = sizes[-1], sum(sizes[:-1])
    assert big == 16 * MIB and sizes[-2] <= MIB and rest > 5 * big  # one big tensor among many small ones
    result = {}
    for side in ("ours", "kept"):
        proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path), side], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-4000:]
        result[side] = json.loads(proc.stdout.strip().splitlines()[-1])
    if not result["ours"]["reset"]:
        pytest.skip("the kernel's peak-RSS mark cannot be reset here (/proc/self/clear_refs)")
    bound = big + rest // 2  # one tensor plus noise; every tensor kept would be big + rest
    assert result["ours"]["above_model"] < bound, (result, big, rest)
    assert result["kept"]["above_model"] > bound, (result, big, rest)  # negative control: the probe sees it
