"""The tables docs/inference-only.md shows, generated from the memory formula (only the tests
use them: test_presentation.py keeps the page equal to them)."""
from __future__ import annotations

from collections.abc import Sequence

from megatron_rl_patches.apps.presentation import human_bytes, markdown_table
from megatron_rl_patches.inference.sizing.memory import TrainingStateBytes

MEMORY_COLUMNS = (
    "model", "DP", "distributed optimizer", "weights (both builds)", "grad buffer", "fp32 main params", "Adam m",
    "Adam v", "trainable build adds", "inference-only adds", "saved", "B/param",
)


def memory_markdown_table(reports: Sequence[tuple[str, TrainingStateBytes]]) -> str:
    """(label, report) rows as the Markdown table docs/inference-only.md shows."""
    rows = [
        [
            label, str(r.dp), "yes" if r.distributed_optimizer else "no", human_bytes(r.weights),
            human_bytes(r.grad_buffer), human_bytes(r.main_params), human_bytes(r.adam_m), human_bytes(r.adam_v),
            f"**{human_bytes(r.total)}**", human_bytes(r.inference_only), f"**{human_bytes(r.saved)}**",
            f"{r.bytes_per_param:g}",
        ]
        for label, r in reports
    ]
    return markdown_table(MEMORY_COLUMNS, rows)


def docs_memory_reports(param_dtype: str = "bf16") -> list[tuple[str, TrainingStateBytes]]:
    """The 7B / 27B / 70B rows at DP=1 and at DP=8 with the distributed optimizer (fp32 grads)."""
    from megatron_rl_patches.inference.sizing.memory import training_state_bytes

    return [
        (f"{size}B", training_state_bytes(size * 10**9, dp=dp, distributed_optimizer=dp > 1, param_dtype=param_dtype))
        for size in (7, 27, 70)
        for dp in (1, 8)
    ]
