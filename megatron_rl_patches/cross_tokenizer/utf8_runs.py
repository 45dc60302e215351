"""Which student tokens of a run spell valid UTF-8: the byte spans a strict UTF-8 decoder rejects,
found in one pass (the decoder's own error spans, recorded by an error handler), and a run split
into the runs whose bytes are valid on their own."""
from __future__ import annotations

import codecs
import threading

import numpy as np

__all__ = ["invalid_spans", "valid_ranges", "valid_runs", "whole_characters"]

_FOUND = threading.local()
# the codec registry is global: a name of this module's own (another copy of it, another revision
# imported beside it for a benchmark, registers its own)
_HANDLER = f"megatron_rl_patches.cross_tokenizer.record_invalid_utf8.{id(_FOUND):x}"


def _record(error: UnicodeError) -> tuple[str, int]:
    if not isinstance(error, UnicodeDecodeError):
        raise error
    _FOUND.spans.append((error.start, error.end))
    return "", error.end


codecs.register_error(_HANDLER, _record)


def invalid_spans(data: bytes) -> list[tuple[int, int]]:
    """Byte spans [start, end) of `data` that are not valid UTF-8, exactly as a strict decoder
    reports them one after another (a truncated character: one span; a stray byte: its own)."""
    try:
        data.decode()
        return []
    except UnicodeDecodeError:
        pass
    spans: list[tuple[int, int]] = []
    _FOUND.spans = spans
    try:
        data.decode("utf-8", _HANDLER)
    finally:
        del _FOUND.spans
    return spans


def _overlapping(starts: np.ndarray, ends: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """Which tokens (byte ranges [starts, ends)) overlap one of the sorted, disjoint `spans`."""
    lo = np.asarray([s for s, _ in spans], dtype=np.int64)
    hi = np.asarray([e for _, e in spans], dtype=np.int64)
    # the only candidate span of a token: the first one ending after the token's start
    j = np.searchsorted(hi, starts, side="right")
    inside = j < len(spans)
    j = np.minimum(j, len(spans) - 1)
    return inside & (starts < hi[j]) & (ends > lo[j])


def _continuation(byte: int) -> bool:
    return 0x80 <= byte < 0xC0


def _edge_spans(data: bytes, p0: int, p1: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]], int, int]:
    """The invalid spans of data[p0:p1], a part whose every byte was inside a valid character of
    the run it was cut from: only a character cut at either end can be invalid now (UTF-8
    resynchronizes at the first character start), so the decoder reads the leading continuation
    bytes and the last character only. (head spans, tail spans, head end, tail start)."""
    h = p0
    while h < p1 and _continuation(data[h]):
        h += 1
    q = p1
    while q > h and _continuation(data[q - 1]):
        q -= 1
    q = q - 1 if q > h else p1  # the last character's start (none after the head: p1)
    head = [(p0 + lo, p0 + hi) for lo, hi in invalid_spans(data[p0:h])]
    tail = [(q + lo, q + hi) for lo, hi in invalid_spans(data[q:p1])]
    return head, tail, h, q


def _edge_bad(starts: list[int], ends: list[int], a: int, b: int, data: bytes) -> list[int] | None:
    """The tokens of part [a, b) overlapping an invalid span of its bytes (None: all valid)."""
    head, tail, h, q = _edge_spans(data, starts[a], ends[b - 1])
    if not head and not tail:
        return None
    bad = []
    k = a
    while head and k < b and starts[k] < h:
        if any(starts[k] < hi and ends[k] > lo for lo, hi in head):
            bad.append(k)
        k += 1
    first_tail = len(bad)
    k = b - 1
    while tail and k >= a and ends[k] > q:
        if any(starts[k] < hi and ends[k] > lo for lo, hi in tail) and k not in bad[:first_tail]:
            bad.append(k)
        k -= 1
    return sorted(bad)


def _between(a: int, b: int, bad: list[int]) -> list[tuple[int, int]]:
    """The ranges of [a, b) between the (sorted) `bad` indices, empty ones left out."""
    cuts = [a - 1, *bad, b]
    return [(lo + 1, hi) for lo, hi in zip(cuts, cuts[1:]) if hi > lo + 1]


def valid_runs(run: list[int], pieces: list[bytes]) -> tuple[list[list[int]], list[int]]:
    """`run` (student token indices, `pieces` their bytes) split into runs whose bytes are valid
    UTF-8 on their own, in order, and the tokens holding invalid bytes (see `valid_ranges`)."""
    if not run:
        return [], []
    lengths = np.fromiter((len(pieces[i]) for i in run), dtype=np.int64, count=len(run))
    valid, excluded = valid_ranges(b"".join(pieces[i] for i in run), np.cumsum(lengths))
    return [run[a:b] for a, b in valid], [run[k] for k in excluded]


def valid_ranges(data: bytes, ends: np.ndarray) -> tuple[list[tuple[int, int]], list[int]]:
    """The tokens of `data` (their end offsets `ends`, non-decreasing) split into ranges [a, b)
    whose bytes are valid UTF-8 on their own, in order, and the tokens holding invalid bytes. A
    character cut by an excluded token counts as invalid: each part is checked again until none
    changes (at its two ends only: linear however long the cascade, which a crafted sequence
    makes as long as itself)."""
    n = ends.size
    spans = invalid_spans(data) if n else []
    if not spans:
        return ([(0, n)] if n else []), []
    starts_array = np.concatenate([np.zeros(1, np.int64), ends[:-1]])
    first_bad = np.nonzero(_overlapping(starts_array, ends, spans))[0].tolist()
    excluded = list(first_bad)
    starts, end_list = starts_array.tolist(), ends.tolist()
    valid: list[tuple[int, int]] = []
    todo = _between(0, n, first_bad)[::-1]
    while todo:
        a, b = todo.pop()
        bad = _edge_bad(starts, end_list, a, b, data)
        if bad is None:
            valid.append((a, b))
            continue
        excluded += bad
        todo += _between(a, b, bad)[::-1]
    return valid, excluded


def whole_characters(data: bytes, ends: np.ndarray, first: np.ndarray, end: np.ndarray,
                     spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs [first, end) of the tokens of `data` (their end offsets `ends`, none empty), all at
    once: (first, end, clean), where `clean` marks the runs overlapping none of `spans` (the whole
    `data`'s `invalid_spans`); each clean run less the tokens at its ends that hold part of a character its edges cut
    (nothing left: first >= end), which is what `valid_ranges` keeps of it (its bytes are valid
    but for those characters, and each token excluded there exposes the next one's cut character).
    Runs not clean come back unchanged: split them with `valid_ranges`."""
    clean = np.ones(first.size, dtype=bool)
    if not first.size:
        return first, end, clean
    octets = np.frombuffer(data, np.uint8)
    starts = np.concatenate([np.zeros(1, np.int64), ends[:-1]])
    at_start = (octets[starts] & 0xC0) != 0x80  # the token's first byte starts a character
    at_end = np.append((octets[ends[:-1]] & 0xC0) != 0x80, True)  # the next byte starts one (or the data ends)
    if spans:
        at_end |= np.isin(ends, [lo for lo, _ in spans])  # a valid stretch ends where an invalid span starts
        clean = ~_overlapping(starts[first], ends[end - 1], spans)
    if at_start[first].all() and at_end[end - 1].all():
        return first, end, clean
    whole_start, whole_end = np.flatnonzero(at_start), np.flatnonzero(at_end)
    kept_first = np.append(whole_start, ends.size)[np.searchsorted(whole_start, first)]
    j = np.searchsorted(whole_end, end) - 1
    kept_end = np.where(j >= 0, whole_end[np.maximum(j, 0)] + 1, 0) if whole_end.size else np.zeros_like(end)
    return kept_first, kept_end, clean
