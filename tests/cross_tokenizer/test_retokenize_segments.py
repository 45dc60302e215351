"""`retokenize` with many segments (a forced boundary every other token, special tokens): linear in
the segments (array elements touched, and Python lines run and list elements read, counted; no
timing), and equal to a simple reference —
each segment encoded alone by the teacher, specials mapped by content, `align` with the segment
starts forced — on random text (Qwen3 → Qwen3.5)."""
from __future__ import annotations

import builtins
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl_patches import cross_tokenizer as ct
from megatron_rl_patches.cross_tokenizer import retokenizing
from tests.cross_tokenizer.conftest import TEXTS

pytest.importorskip("tokenizers")

SPECIALS = ["<|im_end|>", "<|endoftext|>", "<|im_start|>"]  # the same content in both Qwen tokenizers


class Counting(np.ndarray):
    """An array counting the elements its ufuncs (sums, negations) and boolean masks read."""

    touched = 0

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        Counting.touched += sum(np.size(x) for x in inputs if isinstance(x, np.ndarray))
        plain = tuple(x.view(np.ndarray) if isinstance(x, Counting) else x for x in inputs)
        if "out" in kwargs:
            kwargs["out"] = tuple(x.view(np.ndarray) if isinstance(x, Counting) else x for x in kwargs["out"])
        return getattr(ufunc, method)(*plain, **kwargs)

    def __getitem__(self, key):
        if isinstance(key, np.ndarray) and key.dtype == bool:
            Counting.touched += key.size
        return super().__getitem__(key)


class CountingNumpy:
    """numpy for the module under test: every function counts the elements of the array it returns,
    and `zeros` arrays count what their ufuncs and masks read."""

    def __getattr__(self, name):
        value = getattr(np, name)
        if not callable(value) or isinstance(value, type):
            return value

        def counted(*args, **kwargs):
            out = value(*args, **kwargs)
            Counting.touched += sum(np.size(x) for x in (out if isinstance(out, tuple) else (out,))
                                    if isinstance(x, np.ndarray))
            return out

        return counted

    def zeros(self, *args, **kwargs):
        out = np.zeros(*args, **kwargs)
        Counting.touched += out.size
        return out.view(Counting)


def touched_by_retokenize(ids, qwen3, qwen35, monkeypatch) -> int:
    """Array elements the module's numpy calls touch for `ids` with a boundary every other token
    (the result checked against an uncounted call)."""
    marks = list(range(0, len(ids), 2))
    expected = ct.retokenize(ids, qwen3, qwen35, boundaries=marks)
    with monkeypatch.context() as patch:
        patch.setattr(retokenizing, "np", CountingNumpy())
        Counting.touched = 0
        t_ids, alignment = ct.retokenize(ids, qwen3, qwen35, boundaries=marks)
    assert torch.equal(t_ids, expected[0])
    assert same_alignment(alignment, expected[1])
    return Counting.touched


def test_boundary_every_other_token_is_linear(qwen3, qwen35, monkeypatch):
    """The per-segment bookkeeping touches O(1) array elements: doubling the ids (and boundaries)
    doubles the elements touched, a few dozen per id (the quadratic version re-summed every kept
    byte length at each segment: ~n², four times as many at 2n)."""
    tok = ct.load_tokenizer(qwen3)
    base = [i for text in TEXTS.values() for i in tok.encode(text, add_special_tokens=False).ids]
    n = 2000
    ids = (base * (2 * n // len(base) + 1))[:2 * n]
    small = touched_by_retokenize(ids[:n], qwen3, qwen35, monkeypatch)
    large = touched_by_retokenize(ids, qwen3, qwen35, monkeypatch)
    assert 0 < small <= 40 * n, small
    assert large <= 2.3 * small, (small, large)


class PythonWork:
    """The plain-Python work of the cross_tokenizer package: the lines its functions run
    (sys.settrace, its own files only) and the elements its builtin reductions and copies read
    (sum, min, max, sorted, any, all, list, tuple, set: shadowed in its modules), which the numpy
    count above cannot see (a re-sum of a Python list)."""

    BUILTINS = ("sum", "min", "max", "sorted", "any", "all", "list", "tuple", "set")

    def __init__(self, monkeypatch):
        self.count = 0
        self.folder = str(Path(retokenizing.__file__).resolve().parent)
        for name, module in list(sys.modules.items()):
            if name.startswith("megatron_rl_patches.cross_tokenizer") and module is not None:
                for builtin in self.BUILTINS:
                    monkeypatch.setattr(module, builtin, self._counted(getattr(builtins, builtin)), raising=False)

    def _counted(self, builtin):
        work = self

        def counted(*args, **kwargs):
            if args and hasattr(args[0], "__len__"):
                work.count += len(args[0])
            return builtin(*args, **kwargs)

        if not isinstance(builtin, type):
            return counted

        class Counted(type):  # a type stays a type: isinstance(x, (list, tuple)) still works
            def __instancecheck__(cls, obj):
                return isinstance(obj, builtin)

            def __call__(cls, *args, **kwargs):
                return counted(*args, **kwargs)

        return Counted(builtin.__name__, (), {})

    def _line(self, frame, event, arg):
        self.count += event == "line"
        return self._line

    def _call(self, frame, event, arg):
        return self._line if frame.f_code.co_filename.startswith(self.folder) else None

    def of(self, call):
        """The work `call()` does, counted."""
        self.count = 0
        sys.settrace(self._call)
        try:
            call()
        finally:
            sys.settrace(None)
        return self.count


def test_boundary_every_other_token_is_linear_in_python_work_too(qwen3, qwen35, monkeypatch):
    """Twice the ids and boundaries, about twice the Python lines run and list elements read (a
    plain-Python re-sum of the kept byte lengths at each segment, ~n²/2 elements, makes it ~4x)."""
    tok = ct.load_tokenizer(qwen3)
    base = [i for text in TEXTS.values() for i in tok.encode(text, add_special_tokens=False).ids]
    ct.retokenize(base, qwen3, qwen35)  # the tables and encoder built before counting
    work = PythonWork(monkeypatch)
    counts = {}
    for n in (1000, 2000):
        ids = (base * (n // len(base) + 1))[:n]
        counts[n] = work.of(lambda ids=ids, n=n: ct.retokenize(ids, qwen3, qwen35, boundaries=range(0, n, 2)))
    assert counts[1000] > 1000 and counts[2000] / counts[1000] < 2.3, counts


def same_alignment(a, b) -> bool:
    return (torch.equal(a.student_chunk, b.student_chunk) and torch.equal(a.teacher_chunk, b.teacher_chunk)
            and (a.n_chunks, a.invalid_utf8, a.unspelled, a.unmapped_special)
            == (b.n_chunks, b.invalid_utf8, b.unspelled, b.unmapped_special))


def reference(pieces: list[tuple[str, bool]], student, teacher, cut_every: int):
    """(student ids, boundaries, teacher ids, alignment): each piece a text (cut into segments at
    every `cut_every`-th token where the bytes before are whole characters) or a special token."""
    s_tok, t_tok = ct.load_tokenizer(student), ct.load_tokenizer(teacher)
    ids, marks, t_ids, s_bytes, t_bytes = [], [], [], [], []
    for text, special in pieces:
        marks.append(len(ids))
        if special:
            ids.append(s_tok.token_to_id(text))
            t_ids.append(t_tok.token_to_id(text))
            s_bytes.append(text.encode())
            t_bytes.append(text.encode())
            marks.append(len(ids))
            continue
        segment = s_tok.encode(text, add_special_tokens=False).ids
        spelled = ct.token_bytes(student, segment)
        cuts = [k for k in range(cut_every, len(segment), cut_every) if _whole(b"".join(spelled[:k]))]
        for a, b in zip([0, *cuts], [*cuts, len(segment)]):
            marks.append(len(ids) + a)
            encoded = t_tok.encode(b"".join(spelled[a:b]).decode(), add_special_tokens=False).ids
            t_ids += encoded
            t_bytes += ct.token_bytes(teacher, encoded)
        ids += segment
        s_bytes += spelled
    return ids, marks, t_ids, ct.align(s_bytes, t_bytes, boundaries=marks)


def _whole(data: bytes) -> bool:
    try:
        data.decode()
        return True
    except UnicodeDecodeError:
        return False


ALPHABET = st.sampled_from(list("ab xyz.,\n\t  ") + list("的一是了机器") + ["🚀", "é", "👩‍💻", "\u0301"])
PIECE = st.one_of(st.tuples(st.lists(ALPHABET, min_size=1, max_size=12).map("".join), st.just(False)),
                  st.tuples(st.sampled_from(SPECIALS), st.just(True)))


@settings(max_examples=30, deadline=None)
@given(st.lists(PIECE, min_size=1, max_size=6), st.integers(1, 4))
def test_segments_equal_the_reference(qwen3, qwen35, pieces, cut_every):
    ids, marks, t_ids, expected = reference(pieces, qwen3, qwen35, cut_every)
    got_ids, alignment = ct.retokenize(ids, qwen3, qwen35, boundaries=marks)
    assert got_ids.tolist() == t_ids
    assert same_alignment(alignment, expected)
