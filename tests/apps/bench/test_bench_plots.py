"""The benchmark plots read without the table (issue 29, docs/bench/reentrant.png): x labels do not
overlap, a time the unpatched call cannot have is labelled ("crashes"), and every plot in U says
what U is."""
from __future__ import annotations

import itertools

import pytest

from megatron_rl_patches.apps.bench import outputs

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

ROWS = [  # the shape of bench reentrant's rows: long case names, one unpatched time missing
    {"case": "train() guard, 2 chunks", "variant": "unpatched", "us": 0.2},
    {"case": "train() guard, 2 chunks", "variant": "patched", "us": 56.0},
    {"case": "DDP hook disable+enable cycle", "variant": "unpatched", "us": 439.0},
    {"case": "DDP hook disable+enable cycle", "variant": "patched", "us": 705.0},
    {"case": "repeated disable_forward_pre_hook", "variant": "unpatched", "us": None},
    {"case": "repeated disable_forward_pre_hook", "variant": "patched", "us": 49.8},
]


def _figure(**options):
    return outputs.grouped_bars_figure(ROWS, group="case", series="variant", values=["us"], **options)


def test_x_labels_do_not_overlap():
    import matplotlib.pyplot as plt

    fig = _figure(titles=["µs per call"])
    fig.canvas.draw()
    boxes = [label.get_window_extent() for label in fig.axes[0].get_xticklabels()]
    assert len(boxes) == 3
    assert not any(a.overlaps(b) for a, b in itertools.combinations(boxes, 2))
    plt.close(fig)


def test_a_missing_bar_is_labelled_where_it_would_be():
    import matplotlib.pyplot as plt

    fig = _figure(titles=["µs per call"], missing_label="crashes")
    texts = [t for t in fig.axes[0].texts if t.get_text().strip() == "crashes"]
    assert len(texts) == 1 and 1.5 < texts[0].get_position()[0] < 2.5  # the third group
    plt.close(fig)


@pytest.mark.parametrize(("titles", "ylabel", "expected"), [
    (["peak memory (U)"], "", True), (["saved for backward / U"], "", True), (["fwd+bwd time (s)"], "", False),
    (["time"], "bytes in U", True),
])
def test_a_plot_in_u_says_what_u_is(titles, ylabel, expected):
    import matplotlib.pyplot as plt

    fig = _figure(titles=titles, ylabel=ylabel, suptitle="a benchmark")
    title = fig._suptitle.get_text()
    assert (outputs.U_NOTE in title) == expected and title.startswith("a benchmark")
    plt.close(fig)


def test_reentrant_plot_labels_the_unpatched_crash(tmp_path):
    from megatron_rl_patches.apps.bench import reentrant

    rows = [{"case": "repeated disable_forward_pre_hook", "unpatched_us": None, "patched_us": 50.0}]
    path = reentrant.plot(rows, str(tmp_path / "reentrant.png"))
    assert path is not None and (tmp_path / "reentrant.png").stat().st_size > 0


def test_labels_break_between_words_only():
    import matplotlib.pyplot as plt

    fig = _figure(titles=["µs per call"])
    words = {w for row in ROWS for w in row["case"].split()}
    for label in fig.axes[0].get_xticklabels():
        assert all(line.split() and set(line.split()) <= words for line in label.get_text().splitlines())
    assert any("disable_forward_pre_hook" in label.get_text() for label in fig.axes[0].get_xticklabels())
    plt.close(fig)


def test_a_bar_missing_without_a_reason_says_not_measured():
    import matplotlib.pyplot as plt

    fig = _figure(titles=["µs per call"])
    assert [t.get_text().strip() for t in fig.axes[0].texts] == ["not measured"]
    plt.close(fig)


def test_a_panel_without_any_number_says_so_and_one_series_has_no_legend():
    import matplotlib.pyplot as plt

    rows = [{"case": c, "variant": "ours", "peak": None, "us": 1.0} for c in ("a", "b")]
    fig = outputs.grouped_bars_figure(rows, group="case", series="variant", values=["peak", "us"],
                                     titles=["peak (U)", "µs"])
    assert any(" ".join(t.get_text().split()) == outputs.NO_FIGURES for t in fig.axes[0].texts)
    assert not any(" ".join(t.get_text().split()) == outputs.NO_FIGURES for t in fig.axes[1].texts)
    assert all(ax.get_legend() is None for ax in fig.axes)
    plt.close(fig)


def test_an_empty_panel_note_stays_inside_its_panel_with_no_bar_labels_under_it():
    """issue 49: "no figures in this run" ran past the panel and over the "not measured" labels."""
    import matplotlib.pyplot as plt

    rows = [{"case": c, "variant": v, "peak": None, "us": 1.0} for c in ("T=8 V=64", "T=16 V=64")
            for v in ("naive", "ours")]
    fig = outputs.grouped_bars_figure(rows, group="case", series="variant", values=["peak", "us"],
                                     titles=["peak (U)", "µs"])
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (note,) = fig.axes[0].texts  # the note only: no "not measured" under it
    box, panel = note.get_window_extent(renderer), fig.axes[0].get_window_extent(renderer)
    assert panel.x0 <= box.x0 and box.x1 <= panel.x1 and panel.y0 <= box.y0 and box.y1 <= panel.y1
    plt.close(fig)


def test_quick_titles_say_so():
    assert outputs.titled("top-k OPD loss", quick=False) == "top-k OPD loss"
    assert "--quick" in outputs.titled("top-k OPD loss", quick=True).splitlines()[-1]


@pytest.mark.megatron
@pytest.mark.version_blind  # the plot's title: main lane only (test_bench_cli.py holds the crash per lane)
def test_the_reentrant_plot_title_names_device_dtype_and_quick(tmp_path, monkeypatch):
    from megatron_rl_patches.apps.bench import reentrant

    seen = {}
    monkeypatch.setattr(outputs, "plot_grouped_bars", lambda rows, path, **options: seen.update(options))
    reentrant.run(quick=True, out_dir=str(tmp_path))
    assert "CPU" in seen["suptitle"] and "fp32" in seen["suptitle"] and "--quick" in seen["suptitle"]
