"""Presentation shared by the CLI, the benchmarks and the demo: byte counts, text and Markdown
tables, the training-state memory report. Library modules compute; only this module formats."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_rl_patches.inference.sizing.memory import TrainingStateBytes
    from megatron_rl_patches.inference.sizing.residency_plan import ResidencyPlan


def human_bytes(count: float) -> str:
    """Binary units (1 KiB = 1024 B, 1 GiB = 2**30 B): the one unit system of every byte count the
    package prints (demo, CLI, benchmarks, docs)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(count) >= scale:
            return f"{count / scale:,.2f} {unit}"
    return f"{int(count):,} B"


def cell(value: Any) -> str:
    """One table cell: '-' for missing values, 3 significant digits for small floats."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def dict_cells(rows: Sequence[dict], columns: Sequence[str]) -> list[list[str]]:
    """The `columns` of each row dict as cells."""
    return [[cell(row.get(column)) for column in columns] for row in rows]


def text_table(
    columns: Sequence[str], rows: Sequence[Sequence[str]], *, title: str | None = None,
    numeric: bool = False, rule: bool = True,
) -> str:
    """A fixed-width table; `numeric` right-aligns every column but the first; `rule` underlines the header."""
    widths = [max([len(column)] + [len(row[i]) for row in rows]) for i, column in enumerate(columns)]

    def line(cells: Sequence[str]) -> str:
        parts = [c.ljust(w) if (i == 0 or not numeric) else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(parts).rstrip()

    lines = [title] if title else []
    lines.append(line(columns))
    if rule:
        lines.append("  ".join("-" * w for w in widths))
    lines += [line(row) for row in rows]
    return "\n".join(lines)


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table (for docs)."""
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(out)


# ------------------------------------------------------------------ training-state memory


def memory_report(report: TrainingStateBytes) -> str:
    """The per-rank table `megatron-rl-patches memory` prints (and docs/inference-only.md shows)."""
    header = (
        f"Per data-parallel rank: {report.num_params:,} parameters, {report.param_dtype} weights, "
        f"{report.grad_dtype} grads, DP={report.dp}, distributed optimizer: "
        f"{'yes' if report.distributed_optimizer else 'no'}"
    )
    zero = human_bytes(0)
    rows = [[name, human_bytes(value), zero, human_bytes(value)] for name, value in report.components()]
    weights = human_bytes(report.weights)
    rows.append(["total beyond the weights", human_bytes(report.total), human_bytes(report.inference_only),
                 human_bytes(report.saved)])
    per_param = f"{report.bytes_per_param:.2f}"
    rows.append(["bytes per parameter", per_param, "0.00", per_param])
    rows.append([f"weights ({report.param_dtype}, both builds)", weights, weights, zero])
    table = text_table(("component", "trainable", "inference-only", "saved"), rows, numeric=True, rule=False)
    lines = [header, "", table]
    if report.counted_grad_buffer is not None:
        lines.append("")
        lines.append(
            f"grad buffer counted in the DDP model: {human_bytes(report.counted_grad_buffer)} "
            f"({report.counted_grad_buffer:,} B) vs formula {report.grad_buffer:,} B; "
            f"padding {report.grad_buffer_padding:,} B"
        )
        lines += [f"  padding, {name}: {value:,} B" for name, value in report.padding.items()]
    return "\n".join(lines)


def residency_table(plan: ResidencyPlan, chosen: str) -> str:
    """Weight bytes per residency mode (`memory --residency`), the chosen mode marked."""
    header = (
        f"Weights per rank by residency: {plan.layers} layers of {human_bytes(plan.layer_bytes)}, embedding "
        f"{human_bytes(plan.embedding_bytes)}, output layer {human_bytes(plan.output_bytes)}, prefetch {plan.prefetch}"
    )
    note = "host bytes are per data-parallel rank: each rank keeps its own pinned copy of its shard"
    return "\n".join([header, "", modes_table(plan.modes, chosen), "", note])


def modes_table(modes: Any, chosen: str | None) -> str:
    """One row per residency mode (device peak, device between phases, host), the chosen one marked."""
    rows = [[("* " if m.mode == chosen else "  ") + m.mode, human_bytes(m.device_peak),
             human_bytes(m.device_between_phases), human_bytes(m.host)] for m in modes]
    return text_table(("mode", "device (peak)", "device (between phases)", "host"), rows, numeric=True, rule=False)
