"""The student tokens whose bytes are not valid UTF-8: equal to the definition (decode, exclude
the tokens overlapping an invalid span, check each remaining run again) on random pieces, and
linear however many invalid spans or however long the cascade of characters cut by excluded
tokens (test_hostile_input.py runs one of Qwen3's real tokens through `retokenize`)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl_patches.cross_tokenizer import utf8_runs
from megatron_rl_patches.cross_tokenizer.utf8_runs import invalid_spans, valid_runs

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

