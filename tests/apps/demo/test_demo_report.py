"""The demo's text: every figure names what it counts, bytes in binary units only, the real-size
rows state their parameter counts, and no line states the same bytes twice. Summaries are built
from the demo's own real-size rows and the tiny models' measured figures (see test_demo.py)."""
from __future__ import annotations

import re
from dataclasses import asdict

import pytest

from megatron_rl_patches.apps.demo import scale
from megatron_rl_patches.apps.demo.config import DemoConfig
from megatron_rl_patches.apps.demo.report import format_comparison, format_summary

BYTES = re.compile(r"\d[\d,]*(?:\.\d+)? (?:B|KiB|MiB|GiB|TiB)\b")
DECIMAL = re.compile(r"\d[\d,]*(?:\.\d+)? ?(?:kB|KB|MB|GB|TB)\b")
PARAMS = 30_080  # the tiny teacher; its trainable build: 4 B grad + 8 B Adam per parameter (fp32)


def summary(patches: bool) -> dict:
    cfg = DemoConfig()
    one = cfg.micro_batch_size * cfg.seq_length * cfg.vocab_size * 4
    measured = {"grad_buffer": 4 * PARAMS, "optimizer_state": 8 * PARAMS, "total": 12 * PARAMS}
    held = 0 if patches else cfg.teachers * measured["grad_buffer"]
    largest = [cfg.tile_rows, cfg.vocab_size] if patches else [cfg.micro_batch_size * cfg.seq_length, cfg.vocab_size]
    return {
        "ok": patches, "patches": patches, "route": "with" if patches else "without", "device": "cpu",
        "patches_applied": ([{"name": "ddp_hooks", "status": "applied", "reason": "", "description": "d"}]
                            if patches else []),
        "package_pieces": [], "config": asdict(cfg), "rollouts_completed": 1, "rollouts": [],
        "error": None,
        "teachers": {"count": cfg.teachers, "params_per_teacher": PARAMS, "trainable_build_bytes_per_teacher": measured,
                     "formula_bytes_per_teacher": 12 * PARAMS, "allocated_bytes": held,
                     "saved_bytes": cfg.teachers * measured["total"] - held},
        "vocab_wide_tensors": {"largest_shape": largest, "largest_bytes": largest[0] * largest[1] * 4},
        "logits_bytes_per_microbatch": {"one_forward": one, "actor": 2 * one, "teachers": cfg.teachers * one,
                                        "total": (2 + cfg.teachers) * one},
        "real_models": {"teachers": scale.teacher_rows(cfg.teachers),
                        "logits": scale.logits_rows(cfg.teachers, cfg.topk)},
    }


@pytest.mark.parametrize("patches", [True, False])
def test_binary_units_only_and_no_line_repeats_a_figure(patches):
    text = format_summary(summary(patches))
    assert BYTES.search(text) and not DECIMAL.search(text), DECIMAL.findall(text)
    for line in text.splitlines():
        figures = [f for f in BYTES.findall(line) if f != "0 B"]
        assert len(figures) == len(set(figures)), line


def test_real_size_rows_state_their_parameter_counts_and_what_each_column_counts():
    text = format_summary(summary(True))
    for model in scale.REAL_MODELS:
        row = next(line for line in text.splitlines()
                   if line.startswith(f"{model.name} ") and f"{model.params:,}" in line)
        assert "GiB" in row
    assert "fused outputs, per model" in text and "T x (k+1) fp32 values per model" in text
    assert "576.00 KiB" in text  # 16,384 tokens x 9 buckets x 4 B, the same for both vocabularies
    assert "bf16 weights not counted" in text and "V (vocabulary of)" in text


def test_the_teachers_lines_say_what_they_count():
    package, plain = format_summary(summary(True)), format_summary(summary(False))
    assert "grads and optimizer state they hold: 0 B" in package
    assert ("117.50 KiB grad buffer + 235.00 KiB Adam m and v = 352.50 KiB "
            "(the `memory` formula gives the same)") in package
    assert "saved by the 2 inference-only builds: 705.00 KiB" in package
    assert "grad buffers they hold: 235.00 KiB" in plain
    assert ("[T, V] logits allocated (T = 64 tokens per micro-batch, V = 64, fp32): 16.00 KiB per forward x 4 "
            "forwards (the actor's training and old-policy forwards, one per teacher) "
            "= 64.00 KiB per micro-batch") in plain
    assert "at real size" in format_summary(summary(True)) and format_comparison(summary(False), summary(True))


def test_the_closing_lines_name_what_a_slime_user_switches_on():
    from megatron_rl_patches.integrations.megatron.opd.opd_settings import TEACHERS
    from megatron_rl_patches.patching.env import SELECT

    text = format_comparison(summary(False), summary(True))
    assert f"{SELECT}=all" in text and "slime_fused" in text and f"{TEACHERS}=" in text
    # the loss path named is the one slime can load (module path, last dot: slime's load_function)
    assert "megatron_rl_patches.integrations.slime_opd.topk_opd_policy_loss" in text
    from megatron_rl_patches.integrations.slime import opd as slime_opd

    assert callable(slime_opd.topk_opd_policy_loss)
