"""The student tokens whose bytes are not valid UTF-8: equal to the definition (decode, exclude
the tokens overlapping an invalid span, check each remaining run again) on random pieces, and
linear however many invalid spans or however long the cascade of characters cut by excluded
tokens (test_hostile_input.py runs one of Qwen3's real tokens through `retokenize`); the runs
trimmed all at once (`whole_characters`) equal to `valid_ranges` run by run."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl_patches.cross_tokenizer import utf8_runs
from megatron_rl_patches.cross_tokenizer.utf8_runs import invalid_spans, valid_ranges, valid_runs, whole_characters

BYTES = [b"a", b"\xe4", b"\xb8", b"\xad", b"\xf0", b"\x9f", b"\x98", b"\x80", b"\xc3", b"\xa9", b"\xff", b"\xed",
         b"\x9e", b"\xa4"]


def strict_spans(data: bytes) -> list[tuple[int, int]]:
    spans, start = [], 0
    while True:
        try:
            data[start:].decode()
            return spans
        except UnicodeDecodeError as error:
            spans.append((start + error.start, start + error.end))
            start += error.end


def by_definition(run: list[int], pieces: list[bytes]) -> tuple[list[list[int]], set[int]]:
    spans = strict_spans(b"".join(pieces[i] for i in run))
    if not spans:
        return ([run] if run else []), set()
    offsets = [0]
    for i in run:
        offsets.append(offsets[-1] + len(pieces[i]))
    bad = {k for k in range(len(run)) if any(offsets[k] < hi and offsets[k + 1] > lo for lo, hi in spans)}
    valid, excluded, current = [], {run[k] for k in bad}, []
    for k, i in enumerate([*run, None]):
        if i is None or k in bad:
            more, more_bad = by_definition(current, pieces)
            valid += more
            excluded |= more_bad
            current = []
        else:
            current.append(i)
    return valid, excluded


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.sampled_from(BYTES), max_size=3).map(b"".join), max_size=14))
def test_valid_runs_by_definition(pieces):
    run = list(range(len(pieces)))
    assert invalid_spans(b"".join(pieces)) == strict_spans(b"".join(pieces))
    valid, excluded = valid_runs(run, pieces)
    expected_valid, expected_excluded = by_definition(run, pieces)
    assert valid == expected_valid and sorted(excluded) == sorted(expected_excluded)


def test_cascade_is_linear(monkeypatch):
    """`ed | 9e | a4 ed | 9e | a4 ed | … | ff`: each excluded token cuts the character before it,
    n/2 rounds; each round decodes a few bytes at the run's end (once: the whole run)."""
    pieces = [b"\xed"] + [b"\x9e", b"\xa4\xed"] * 2000 + [b"\xff"]
    decoded = []
    monkeypatch.setattr(utf8_runs, "invalid_spans", lambda data: decoded.append(len(data)) or invalid_spans(data))
    valid, excluded = valid_runs(list(range(len(pieces))), pieces)
    assert valid == [] and sorted(excluded) == list(range(len(pieces)))
    assert sum(decoded) <= 4 * sum(map(len, pieces)), sum(decoded)



CHARACTERS = ["a", " ", "é", "中", "文", "😀", "\u200d"]


def trimmed_by_valid_ranges(pieces: list[bytes], cuts: list[int]) -> tuple[list[tuple[int, int]], set[int]]:
    """Each run [cuts[k], cuts[k + 1]) of `pieces` split by `valid_ranges` on its own bytes."""
    ends = np.cumsum([len(p) for p in pieces])
    kept, excluded = [], set()
    for a, b in zip(cuts, cuts[1:]):
        lo = int(ends[a - 1]) if a else 0
        valid, bad = valid_ranges(b"".join(pieces[a:b]), ends[a:b] - lo)
        kept += [(a + p, a + q) for p, q in valid]
        excluded |= {a + k for k in bad}
    return kept, excluded


@settings(max_examples=300, deadline=None)
@given(st.text(st.sampled_from(CHARACTERS), min_size=1, max_size=20), st.data())
def test_whole_characters_is_valid_ranges_run_by_run(text, data):
    """Valid text cut into tokens at any byte and into runs at any token, maybe with stray bytes
    inserted: the clean runs trimmed at once keep and exclude what `valid_ranges` does run by run."""
    raw = text.encode()
    splits = sorted(data.draw(st.sets(st.integers(1, len(raw) - 1))) if len(raw) > 1 else [])
    pieces = [raw[a:b] for a, b in zip([0, *splits], [*splits, len(raw)])]
    for at in data.draw(st.lists(st.integers(0, len(pieces)), max_size=2)):
        pieces.insert(at, data.draw(st.sampled_from([b"\x80", b"\xff", b"\xe4\xb8"])))
    inner = sorted(data.draw(st.sets(st.integers(1, len(pieces) - 1))) if len(pieces) > 1 else [])
    cuts = [0, *inner, len(pieces)]
    joined = b"".join(pieces)
    ends = np.cumsum([len(p) for p in pieces])
    first, end = np.array(cuts[:-1]), np.array(cuts[1:])
    kept_first, kept_end, clean = whole_characters(joined, ends, first, end, invalid_spans(joined))
    expected, excluded = trimmed_by_valid_ranges(pieces, cuts)
    for k in np.flatnonzero(clean).tolist():
        a, b = cuts[k], cuts[k + 1]
        run_kept = [(p, q) for p, q in expected if a <= p < b]
        assert run_kept == ([(int(kept_first[k]), int(kept_end[k]))] if kept_first[k] < kept_end[k] else [])
        assert {i for i in excluded if a <= i < b} == set(range(a, b)) - set(range(*(run_kept or [(0, 0)])[0]))
    if not invalid_spans(joined):
        assert clean.all()


def test_whole_characters_trims_a_cut_character():
    """A negative control: runs cut inside 中 (3 bytes in 3 tokens) lose those tokens, not the rest."""
    pieces = [b"a", b"\xe4", b"\xb8", b"\xad", b"b"]
    ends = np.cumsum([len(p) for p in pieces])
    first, end = np.array([0, 2]), np.array([2, 5])  # the runs [a, e4] and [b8, ad, b]
    kept_first, kept_end, clean = whole_characters(b"".join(pieces), ends, first, end, [])
    assert clean.all() and kept_first.tolist() == [0, 4] and kept_end.tolist() == [1, 5]
