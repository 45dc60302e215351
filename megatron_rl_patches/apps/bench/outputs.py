"""A benchmark's outputs: its tables (text, markdown, CSV) and its grouped-bar figures (PNG, with
matplotlib when installed)."""
# lazy imports: optional dependency matplotlib (the [bench] extra): only --out plots need it
from __future__ import annotations

import csv
import math
import os
import re
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

from megatron_rl_patches.apps.presentation import dict_cells, markdown_table, text_table


def format_table(rows: Sequence[dict], columns: Sequence[str], title: str | None = None) -> str:
    """A fixed-width text table of `columns` (missing values shown as '-')."""
    return text_table(columns, dict_cells(rows, columns), title=title)


def print_table(rows: Sequence[dict], columns: Sequence[str], title: str | None = None) -> None:
    """Print :func:`format_table` (benchmarks are CLI output)."""
    print(format_table(rows, columns, title), flush=True)


def write_csv(rows: Sequence[dict], path: str, columns: Sequence[str] | None = None) -> str:
    """Write rows to `path` (columns: the given ones, else every key in first-seen order)."""
    if columns is None:
        columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({col: row.get(col, "") for col in columns})
    return path


def write_tables(rows: Sequence[dict], columns: Sequence[str], out_dir: str, name: str,
                 title: str | None = None) -> None:
    """`name`.csv (every field) and `name`.md (`columns`, under `title` when given) into `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    write_csv(rows, os.path.join(out_dir, f"{name}.csv"))
    table = markdown_table(columns, dict_cells(rows, columns))
    with open(os.path.join(out_dir, f"{name}.md"), "w") as fh:
        fh.write((f"{title}\n\n{table}" if title else table) + "\n")


# Every plot whose panels are in U says what U is (issue 29: the unit was only in the tables).
U_NOTE = "U = T·V·4 bytes (one fp32 copy of the [T, V] logits)"
_LABEL_WIDTH = 16  # characters per line of an x label: wrapped, so neighbours do not overlap


NO_FIGURES = "no figures in this run: see the table's notes (--quick shapes are below memory resolution on CPU)"
_NOTE_WIDTH = 34  # characters per line of a panel's note: it stays inside the panel
QUICK_NOTE = "[--quick: tiny shapes, fixed costs dominate; not representative]"


def measured(measure: Callable[[], list[dict]], key: str) -> list[dict]:
    """`measure()`'s rows, or one row saying why the benchmark could not run (its `key` column
    "all", the error, and a note every benchmark shows)."""
    try:
        return measure()
    except Exception as exc:  # noqa: BLE001 - one row saying why, as every benchmark reports it
        return [{key: "all", "error": f"{type(exc).__name__}: {exc}", "note": f"error: {exc}"[:300]}]


def reported(rows: list[dict], columns: Sequence[str], title: str, out_dir: str | None, name: str,
             plot: Callable[[list[dict], str], None] | None = None) -> list[dict]:
    """`rows` printed under `title` and, with `out_dir`, written as `name`.csv / .md with, where no
    row failed, `plot(rows, path)` drawn to `name`.png; the rows back."""
    print_table(rows, columns, title=title)
    if out_dir:
        write_tables(rows, columns, out_dir, name, title=title)
        if plot is not None and "error" not in rows[0]:
            plot(rows, os.path.join(out_dir, f"{name}.png"))
    return rows


def gpt_words(plan: dict) -> str:
    """A benchmark's tiny GPTModel as its title says it (its plan's layers, hidden, vocab and top-k)."""
    return (f"GPTModel {plan['layers']} layers x {plan['hidden']} hidden, vocab {plan['vocab']}, fp32 CPU, "
            f"top-{plan['top_k']}")


def titled(title: str, quick: bool) -> str:
    """A table's or plot's title, saying --quick where it was (its figures mean little)."""
    return f"{title}\n{QUICK_NOTE}" if quick else title


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _wrapped(label: str) -> str:
    """`label` on lines of about _LABEL_WIDTH characters, broken between words only (a name such
    as disable_forward_pre_hook stays whole)."""
    return "\n".join(line for part in label.split("\n")
                     for line in textwrap.wrap(part, _LABEL_WIDTH, break_long_words=False, break_on_hyphens=False)
                     or [part])


def _uses_u(texts: Sequence[str]) -> bool:
    return any(re.search(r"(^|[\s(/])U(\b|$)", text) for text in texts)


def grouped_bars_figure(
    rows: Sequence[dict], *, group: str, series: str, values: Sequence[str], titles: Sequence[str],
    suptitle: str = "", ylabel: str = "", missing_label: str = "not measured", empty_note: str = NO_FIGURES,
) -> Any:
    """The figure of :func:`plot_grouped_bars` (matplotlib imported by the caller). A series with
    no number for a group gets `missing_label` written where its bar would be (e.g. "crashes"); a
    panel with no number at all says `empty_note` instead of showing an empty axis."""
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(str(row[group]) for row in rows))
    names = list(dict.fromkeys(str(row[series]) for row in rows))
    labels = [_wrapped(g) for g in groups]
    longest = max((len(line) for label in labels for line in label.splitlines()), default=1)
    panel = max(5.5, len(groups) * max(0.6, 0.08 * longest) + 1.5)  # inches: room for every label
    fig, axes = plt.subplots(1, len(values), figsize=(panel * len(values), 4.2), squeeze=False)
    width = 0.8 / max(1, len(names))
    for ax, value, title in zip(axes[0], values, titles):
        empty = not any(_finite(r.get(value)) for r in rows)  # e.g. memory below resolution in --quick
        if empty:  # the note alone, wrapped to the panel: no per-bar labels under it
            ax.text(0.5, 0.6, textwrap.fill(empty_note, _NOTE_WIDTH), transform=ax.transAxes, ha="center",
                    va="center", fontsize=8)
            ax.set_yticks([])
        for i, name in enumerate(names):
            heights, missing = [], []
            for j, g in enumerate(groups):
                match = [r for r in rows if str(r[group]) == g and str(r[series]) == name]
                v = match[0].get(value) if match else None
                number = _finite(v)
                heights.append(float(v) if number else 0.0)
                if match and not number:
                    missing.append(j + i * width)
            ax.bar([j + i * width for j in range(len(groups))], heights, width, label=name)
            for x in missing if missing_label and not empty else ():
                ax.text(x, 0, f" {missing_label}", rotation=90, ha="center", va="bottom", fontsize=8)
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(groups))])
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    if len(names) > 1:  # one series needs no legend (an empty-looking box otherwise)
        axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if _uses_u([*titles, ylabel]) and U_NOTE not in suptitle:
        suptitle = f"{suptitle}\n{U_NOTE}" if suptitle else U_NOTE
    if suptitle:
        fig.suptitle(suptitle, fontsize=11)
    fig.tight_layout()
    return fig


def plot_grouped_bars(
    rows: Sequence[dict], path: str, *, group: str, series: str, values: Sequence[str], titles: Sequence[str],
    suptitle: str = "", ylabel: str = "", missing_label: str = "not measured", empty_note: str = NO_FIGURES,
) -> str | None:
    """One panel per entry of `values`: bars of each `series` within each `group`, written to
    `path`. Needs matplotlib (imported here only); returns the path, or None when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig = grouped_bars_figure(rows, group=group, series=series, values=values, titles=titles, suptitle=suptitle,
                              ylabel=ylabel, missing_label=missing_label, empty_note=empty_note)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
