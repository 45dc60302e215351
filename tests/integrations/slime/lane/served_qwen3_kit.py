"""What the slime lane's served-teacher modules share: the checkpoint a vLLM server serves beside the
lane's tiny GPT (`served_checkpoint`: a tiny random Qwen3 of the GPT's vocabulary with a word-level
tokenizer; its directory is also slime's --hf-checkpoint, the student's tokenizer) and slime's real
rollout run in its own interpreter (`slime_rollout`: `slime_rollout_scores.py`, as slime's rollout
manager runs in a process of its own). Both skip naming MRP_VLLM_PYTHON where it is unset (the
slime lane is outside `make test`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_rl_patches.testing.hf_checkpoints import (
    save_word_tokenizer,
    tiny_hf_config,
    transformers_layout,
    write_tiny_checkpoint,
)

HERE = os.path.dirname(__file__)
VLLM_PYTHON = os.environ.get("MRP_VLLM_PYTHON", "")
VOCAB = 64  # the lane's tiny GPT's vocabulary (slime_kit.VOCAB), the served model's too
SHAPE = dict(hidden_size=64, head_dim=32, intermediate_size=96, max_position_embeddings=256, vocab_size=VOCAB)
NO_VLLM = "MRP_VLLM_PYTHON names vLLM's interpreter (the served lane's, .lanes/vllm/bin/python): unset"


def served_checkpoint(root: Path) -> Path:
    """`root`/qwen3: the tiny Qwen3 (seed 3, `architectures` naming the causal LM: vLLM's generate
    runner, not pooling) and the lane's word tokenizer; skips without MRP_VLLM_PYTHON."""
    if not VLLM_PYTHON:
        pytest.skip(NO_VLLM)
    directory = root / "qwen3"
    config = {**transformers_layout(tiny_hf_config("qwen3", **SHAPE)), "architectures": ["Qwen3ForCausalLM"]}
    write_tiny_checkpoint(directory, config, seed=3)
    save_word_tokenizer(directory, VOCAB)
    return directory


def slime_rollout(tmp_path: Path, name: str, config: dict[str, Any], teachers: str, score_at: str) -> dict:
    """slime's rollout (`slime_rollout_scores.py` with `config`, its "out" set here) in a fresh
    interpreter with the served teachers `teachers` (MEGATRON_RL_PATCHES_OPD_TEACHERS; K 4, the ids
    from the teacher) asked at `score_at`: its one round (the rank's data, the logged figures) and
    the JSON line it printed ("printed")."""
    out = tmp_path / f"rollout-{name}.pt"
    (tmp_path / f"rollout-{name}.json").write_text(json.dumps({**config, "out": str(out)}))
    env = {**os.environ, "MEGATRON_RL_PATCHES_OPD_TEACHERS": teachers, "MEGATRON_RL_PATCHES_OPD_K": "4",
           "MEGATRON_RL_PATCHES_OPD_IDS_FROM": "teacher", "MEGATRON_RL_PATCHES_OPD_SCORE_AT": score_at}
    env.pop("MEGATRON_RL_PATCHES", None)
    done = subprocess.run([sys.executable, "-W", "ignore", os.path.join(HERE, "slime_rollout_scores.py"),
                           str(tmp_path / f"rollout-{name}.json")], env=env, capture_output=True, text=True,
                          timeout=600, cwd=HERE)
    assert done.returncode == 0, done.stderr[-4000:]
    (one,) = torch.load(out, weights_only=False)["rounds"]
    return {**one, "printed": json.loads(done.stdout.strip().splitlines()[-1])}
