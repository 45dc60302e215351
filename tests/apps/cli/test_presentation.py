"""Presentation (megatron_rl_patches.apps.presentation): byte units, tables, the memory report, the docs'
generated tables; and no library module formats any more."""
import sys
from pathlib import Path

from megatron_rl_patches.apps.presentation import human_bytes, markdown_table, memory_report, text_table
from megatron_rl_patches.inference.sizing.memory import training_state_bytes

sys.path.insert(0, str(Path(__file__).parent))
from docs_tables import docs_memory_reports, memory_markdown_table  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


def test_memory_report_table():
    text = memory_report(training_state_bytes(27e9))
    assert "402.33 GiB" in text and "inference-only" in text
    lines = text.splitlines()
    total = next(line for line in lines if line.startswith("total beyond the weights"))
    assert total.split()[-6:] == ["402.33", "GiB", "0", "B", "402.33", "GiB"]  # 432e9 B
    per_param = next(line for line in lines if line.startswith("bytes per parameter"))
    assert per_param.split()[-3:] == ["16.00", "0.00", "16.00"]


def test_docs_show_the_memory_report_as_printed():
    page = (REPO / "docs" / "inference-only.md").read_text()
    printed = memory_report(training_state_bytes(27e9))
    assert printed in page


def test_human_bytes_uses_binary_units():
    assert human_bytes(432e9) == "402.33 GiB"
    assert human_bytes(1.5 * 2**40) == "1.50 TiB"
    assert human_bytes(123_392) == "120.50 KiB"
    assert human_bytes(2**20) == "1.00 MiB"
    assert human_bytes(999) == "999 B"
    assert human_bytes(0) == "0 B"


def test_tables():
    assert markdown_table(["a", "b"], [["1", "2"]]) == "| a | b |\n|---|---|\n| 1 | 2 |"
    assert text_table(["name", "n"], [["x", "10"], ["long", "2"]], numeric=True, rule=False).splitlines() == [
        "name   n", "x     10", "long   2",
    ]
    assert text_table(["a"], [["xy"]], title="t").splitlines() == ["t", "a", "--", "xy"]


def test_docs_show_the_generated_tables():
    page = (REPO / "docs" / "inference-only.md").read_text()
    for dtype in ("bf16", "fp32"):
        block = page.split(f"<!-- memory-table:{dtype} -->\n", 1)[1].split("<!-- /memory-table -->", 1)[0]
        assert block.strip() == memory_markdown_table(docs_memory_reports(dtype))
    assert "| 27B | 1 | no | 50.29 GiB | 100.58 GiB | 100.58 GiB | 100.58 GiB | 100.58 GiB | **402.33 GiB**" in page
    assert "memory_markdown_table(docs_memory_reports())` in `tests/apps/cli/docs_tables.py`" in page.replace("\n", " ")


def test_library_modules_do_not_format():
    """Formatting lives in presentation (and the apps): no library module defines these any more."""
    import megatron_rl_patches.inference as inference
    import megatron_rl_patches.inference.sizing.memory as memory

    for name in ("human_bytes", "format_report", "markdown_table", "docs_reports"):
        assert not hasattr(memory, name), name
    assert "format_report" not in inference.__all__
