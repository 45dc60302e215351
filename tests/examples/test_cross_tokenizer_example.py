"""The worked cross-tokenizer example (examples/cross_tokenizer_cpu.py): a byte-level BPE student
distilled on its own samples from a byte-fallback SentencePiece-style teacher; both signals fall."""
import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cross_tokenizer_cpu.py"


def _example():
    spec = importlib.util.spec_from_file_location("cross_tokenizer_cpu", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module


@pytest.mark.slow
def test_the_student_moves_towards_the_teacher():
    records = _example().main(steps=10)
    first = [sum(r) for r in records[:3]]
    last = [sum(r) for r in records[-3:]]
    assert sum(last) < 0.8 * sum(first), records


def test_the_printed_table_says_what_each_column_means():
    """The report of given records (no training): each column explained above the table."""
    module = _example()
    text = module.report([(8.25, 6.5), (4.0, 3.125)])
    explained, table = text.split("\n\n")[0], text.split("\n\n")[1]
    header = table.splitlines()[0]
    for name, _ in module.COLUMNS:
        assert f"  {name}: " in explained and name in header, name
    assert table.splitlines()[1:] == ["   0              8.2500                  6.5000",
                                      "   1              4.0000                  3.1250"]
    assert "fall" in text.split("\n\n")[2]
