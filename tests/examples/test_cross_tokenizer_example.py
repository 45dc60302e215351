"""The worked cross-tokenizer example (examples/cross_tokenizer_cpu.py): a byte-level BPE student
distilled on its own samples from a byte-fallback SentencePiece-style teacher; both signals fall."""
import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cross_tokenizer_cpu.py"


def test_the_student_moves_towards_the_teacher():
    spec = importlib.util.spec_from_file_location("cross_tokenizer_cpu", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        records = module.main(steps=10)
    finally:
        sys.modules.pop(spec.name, None)
    first = [sum(r) for r in records[:3]]
    last = [sum(r) for r in records[-3:]]
    assert sum(last) < 0.8 * sum(first), records
