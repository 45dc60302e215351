"""The `run()` every table-and-figure benchmark shares: the clock started, the import notes hidden,
the rows measured (one error row where the measurement raises, `outputs.measured`), the title with
the seconds so far, the table printed and, with an output folder, written with its grouped-bar
figure (`outputs.reported`). A benchmark names what differs: its measurement, its title and its
bars (`Bars`)."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_rl_patches.apps.bench import outputs
from megatron_rl_patches.apps.quiet import hide_import_notes


@dataclass(frozen=True)
class Bars:
    """The grouped-bar figure of a benchmark's rows: `group` and `series` columns, one panel per
    `values` column under its `titles`; `shown(row)`: the row the figure reads (a series column the
    table has not), the row itself by default."""

    group: str
    series: str
    values: Sequence[str]
    titles: Sequence[str]
    shown: Callable[[dict], dict] | None = None


def run_benchmark(name: str, measure: Callable[[], list[dict]], key: str, columns: Sequence[str],
                  described: str, bars: Bars, quick: bool, out_dir: str | None, *,
                  hide_notes: bool = True) -> list[dict]:
    """`measure()`'s rows printed under `described` and the seconds since the start (`--quick` said);
    with `out_dir`, written as `name`.csv / .md / .png. `key`: the column of the error row where
    `measure` raises."""
    started = time.perf_counter()
    if hide_notes:
        hide_import_notes()
    rows = outputs.measured(measure, key)
    heading = outputs.titled(f"{described} ({time.perf_counter() - started:.0f} s from the benchmark's start)", quick)

    def plot(rows: list[dict], path: str) -> None:
        shown = [bars.shown(row) for row in rows] if bars.shown is not None else rows
        outputs.plot_grouped_bars(shown, path, group=bars.group, series=bars.series, values=bars.values,
                                  titles=bars.titles, suptitle=heading)

    return outputs.reported(rows, columns, heading, out_dir, name, plot)
