"""The demo's configuration: plain data, no torch, so `megatron-rl-patches demo` can build its
argument parser and refuse bad arguments before the slow imports of the loop."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DemoConfig:
    """One demo run: the tiny models' sizes, the loop's lengths and the loss coefficients."""

    rollouts: int = 4
    steps: int = 2  # optimizer steps per rollout
    microbatches: int = 2
    micro_batch_size: int = 4
    prompt_length: int = 4
    seq_length: int = 16
    vocab_size: int = 64
    teachers: int = 2
    topk: int = 8
    # whose top-k ids the OPD buckets use: "student" (slime_opd's default), "union", or "teacher" (the
    # first teacher's; the demo only: MEGATRON_RL_PATCHES_OPD_IDS_FROM takes student or union)
    ids_from: str = "student"
    opd_coef: float = 1.0
    pg_coef: float = 0.1
    temperature: float = 1.0
    lr: float = 1.0
    device: str = "cpu"  # "cuda" when the session runs on a GPU
    teacher_init_std: float = 0.3
    tile_rows: int = 16  # rows per logits tile of the fused ops (real sizes: their default, 1024)
    seed: int = 0
