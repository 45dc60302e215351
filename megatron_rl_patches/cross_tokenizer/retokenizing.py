"""The teacher's own encoding of a student sample's bytes, and their alignment: the text split at
special tokens (mapped to the teacher's, else excluded), forced boundaries and bytes that are not
valid UTF-8 (excluded), each segment encoded with no BOS/EOS and no dummy prefix."""
from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from megatron_rl_patches.cross_tokenizer.alignment import Alignment, chunks_from_ends
from megatron_rl_patches.cross_tokenizer.arguments import as_index_list, as_int_array, as_int_list, is_int
from megatron_rl_patches.cross_tokenizer.spelling import ByteTable, SpellingArrays, component_spec, table_of
from megatron_rl_patches.cross_tokenizer.utf8_runs import invalid_spans, valid_ranges, whole_characters

__all__ = ["retokenize"]

StopTokens = Mapping[int, int] | Callable[[int], "int | None"] | None


def _without_dummy_prefix(tokenizer: Any) -> Any:
    """A copy of `tokenizer` that adds no SentencePiece dummy prefix (a segment continues the text
    before it); the tokenizer itself when it adds none."""
    light = json.dumps([component_spec(tokenizer.normalizer), component_spec(tokenizer.pre_tokenizer)])
    if '"Metaspace"' not in light and '"Prepend"' not in light:
        return tokenizer
    spec = json.loads(tokenizer.to_str())
    changed = False

    def strip(node: Any) -> Any:
        nonlocal changed
        if not isinstance(node, dict):
            return node
        if node.get("type") == "Metaspace" and node.get("prepend_scheme", "always") != "never":
            node = {**node, "prepend_scheme": "never", "add_prefix_space": False}
            changed = True
        for key in ("normalizers", "pretokenizers"):
            if isinstance(node.get(key), list):
                kept = [strip(n) for n in node[key] if not (isinstance(n, dict) and n.get("type") == "Prepend")]
                changed |= len(kept) != len(node[key])
                node = {**node, key: kept}
        if node.get("type") == "Prepend":
            changed = True
            return None
        return node

    spec["normalizer"] = strip(spec.get("normalizer"))
    spec["pre_tokenizer"] = strip(spec.get("pre_tokenizer"))
    spec["post_processor"] = None  # never BOS/EOS
    if not changed:
        return tokenizer
    return type(tokenizer).from_str(json.dumps(spec))


def _encoder(table: ByteTable) -> Any:
    return table.cached("encoder", None, lambda: _without_dummy_prefix(table.tokenizer))


def _encode_all(encoder: Any, texts: list[str]) -> list[list[int]]:
    """Each text's ids in one call (the library's batch call without offsets where it has it)."""
    if not texts:
        return []
    batch = getattr(encoder, "encode_batch_fast", encoder.encode_batch)
    return [e.ids for e in batch(texts, add_special_tokens=False)]


def _same(a: ByteTable, b: ByteTable) -> bool:
    return a.cached("same", b, lambda: a is b or (a.spelled == b.spelled and a.special == b.special))


def _stop_map(stop_tokens: StopTokens, student: ByteTable, teacher: ByteTable) -> Callable[[int], int | None]:
    """Student special id → teacher id: the user's table / hook first, else the teacher's special
    token of the same content, else None (excluded and counted)."""
    if stop_tokens is not None and not (callable(stop_tokens) or isinstance(stop_tokens, Mapping)):
        raise TypeError("stop_tokens must be a mapping {student id: teacher id}, a callable(student id) -> teacher "
                        f"id or None, or None; got {type(stop_tokens).__name__}")

    def mapped(i: int) -> int | None:
        if callable(stop_tokens):
            found, source = stop_tokens(i), f"stop_tokens (the hook) returned {{}} for student id {i}"
        elif stop_tokens is not None:
            found, source = stop_tokens.get(i), f"stop_tokens[{i}] is {{}}"
        else:
            found, source = None, ""
        if found is not None and not is_int(found):
            raise TypeError(f"{source.format(repr(found))} ({type(found).__name__}): stop_tokens must give a teacher "
                            "token id as an int, or None for a token with no teacher equal")
        if found is None:
            content = student.spelled[i]
            found = teacher.special_by_content.get(content.decode(errors="replace")) if content is not None else None
        known = found is not None and 0 <= int(found) < len(teacher.spelled) and teacher.spelled[int(found)] is not None
        if found is not None and not known:
            raise ValueError(f"stop_tokens maps student id {i} to {found}, not an id of the teacher's tokenizer")
        return None if found is None else int(found)

    return mapped


def retokenize(student_ids: Sequence[int] | torch.Tensor, student_tokenizer: Any, teacher_tokenizer: Any, *,
               boundaries: Sequence[int] = (), stop_tokens: StopTokens = None) -> tuple[torch.Tensor, Alignment]:
    """(teacher ids int64 [n_teacher], alignment) for one sample's student ids (a response: it
    continues its prompt, so no BOS/EOS and no dummy prefix are added). With one tokenizer on both
    sides the ids come back unchanged, each token its own chunk. `boundaries`: student token
    indices where a chunk must start (a loss-mask change). `stop_tokens`: student special id →
    teacher id (a mapping or a callable returning None for none); by default a special token maps
    to the teacher's special token of the same content, and one with none is excluded (chunk −1,
    counted in `alignment.unmapped_special`)."""
    student = table_of(student_tokenizer, "student_tokenizer")
    teacher = table_of(teacher_tokenizer, "teacher_tokenizer")
    spelling = student.arrays()
    try:
        ids = as_int_array(student_ids, "student_ids")
    except OverflowError:  # an int past int64: name it as any unknown id
        student.of(as_int_list(student_ids, "student_ids"), "student_ids")
        raise
    lengths = spelling.lengths_of(ids, "student_ids")
    n = ids.size
    marks = sorted(set(as_index_list(boundaries, "boundaries")))
    if any(b < 0 or b > n for b in marks):
        raise ValueError(f"boundaries must be student token indices in [0, {n}], got {marks}")
    if _same(student, teacher):
        chunk = torch.arange(n, dtype=torch.int64)
        same_ids = torch.as_tensor(student_ids, dtype=torch.int64) if isinstance(student_ids, torch.Tensor) \
            else torch.from_numpy(ids.copy())
        return same_ids, Alignment(chunk, chunk.clone(), n)
    return _Retokenizing(ids, lengths, spelling, teacher, _stop_map(stop_tokens, student, teacher)).run(marks)


class _Retokenizing:
    """One sample's retokenizing without a Python step per token: the runs between boundaries and
    special tokens encoded in one batch call, the teacher's bytes checked in one comparison, the
    alignment built from arrays."""

    def __init__(self, ids: np.ndarray, lengths: np.ndarray, spelling: SpellingArrays, teacher: ByteTable,
                 stop: Callable[[int], int | None]) -> None:
        self.ids, self.lengths, self.teacher, self.stop = ids, lengths, teacher, stop
        self.data = spelling.spell(ids, lengths)
        self.ends = np.cumsum(lengths)
        self.special = spelling.special[ids]
        self.excluded = np.zeros(ids.size, dtype=bool)
        self.counts = {"invalid_utf8": 0, "unspelled": 0, "unmapped_special": 0}

    def exclude(self, tokens: Any, why: str) -> None:
        self.excluded[tokens] = True
        self.counts[why] += len(tokens)

    def starts_at(self, token: np.ndarray) -> np.ndarray:
        """The byte offset where each token index starts (the sample's length past the end)."""
        return np.where(token > 0, self.ends[np.maximum(token - 1, 0)], 0) if self.ends.size else token * 0

    def valid_parts(self, a: int, b: int, lo: int, hi: int) -> list[tuple[int, int, str]]:
        """Tokens [a, b) (bytes [lo, hi)) as ranges whose bytes are valid UTF-8, with their text;
        the tokens holding invalid bytes excluded."""
        try:
            return [(a, b, self.data[lo:hi].decode())]
        except UnicodeDecodeError:
            pass
        valid, bad = valid_ranges(self.data[lo:hi], self.ends[a:b] - lo)
        self.exclude([a + k for k in bad], "invalid_utf8")
        parts = []
        for p, q in valid:
            p_lo = int(self.ends[a + p - 1]) if a + p else 0
            parts.append((a + p, a + q, self.data[p_lo:int(self.ends[a + q - 1])].decode()))
        return parts

    def segments(self, marks: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str], list[int]]:
        """The sample cut at boundaries and special tokens: per kept segment in order, its first
        token, end token and whether it is a special token (arrays), then the runs' texts and the
        special tokens' teacher ids, each in order."""
        n = self.ids.size
        cut = np.zeros(n + 1, dtype=bool)
        cut[[0, n, *marks]] = True
        specials = np.flatnonzero(self.special)
        cut[specials] = cut[specials + 1] = True
        edges = np.flatnonzero(cut)
        first, end = edges[:-1], edges[1:]
        special = self.special[first]
        mapped: list[int] = []
        if specials.size:
            kept_special = []
            for a in first[special].tolist():
                teacher_id = self.stop(int(self.ids[a]))
                if teacher_id is None:
                    self.exclude([a], "unmapped_special")
                else:
                    mapped.append(teacher_id)
                kept_special.append(teacher_id is not None)
            special[special] = kept_special
            runs = ~self.special[first]
        else:
            runs = np.ones(first.size, dtype=bool)
        r_first, r_end, texts = self.runs(first[runs], end[runs])
        if not mapped:
            return r_first, r_end, np.zeros(r_first.size, dtype=bool), texts, mapped
        all_first = np.concatenate([r_first, first[special]])
        order = np.argsort(all_first, kind="stable")
        all_end = np.concatenate([r_end, end[special]])[order]
        is_special = np.concatenate([np.zeros(r_first.size, dtype=bool), np.ones(len(mapped), dtype=bool)])[order]
        return all_first[order], all_end, is_special, texts, mapped

    def runs(self, first: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """The runs [first, end) between specials and boundaries as ranges whose bytes are valid
        UTF-8, with their texts; the tokens holding invalid bytes excluded. A run inside a valid
        stretch of the sample's bytes is invalid only where its edges cut a character: those runs
        trimmed all at once, the others split one by one."""
        if self.lengths.size and not self.lengths.min():
            return self.runs_one_by_one(first, end)
        try:
            whole, spans = self.data.decode(), []
        except UnicodeDecodeError:
            whole, spans = None, invalid_spans(self.data)
        kept_first, kept_end, clean = whole_characters(self.data, self.ends, first, end, spans)
        kept = clean & (kept_first < kept_end)
        if kept_first is not first:
            trimmed = clean & ((kept_first != first) | (kept_end != end))
            head_end, tail_start = np.where(kept, kept_first, end)[trimmed], np.where(kept, kept_end, end)[trimmed]
            cut_first, cut_end = first[trimmed], end[trimmed]
            size = self.ids.size + 1
            opened = np.bincount(cut_first, minlength=size) - np.bincount(head_end, minlength=size) + \
                np.bincount(tail_start, minlength=size) - np.bincount(cut_end, minlength=size)
            self.excluded |= np.cumsum(opened[:-1]) > 0
            self.counts["invalid_utf8"] += int((head_end - cut_first).sum() + (cut_end - tail_start).sum())
        r_first, r_end = kept_first[kept], kept_end[kept]
        texts = self.texts(r_first, r_end, whole)
        if clean.all():
            return r_first, r_end, texts
        o_first, o_end, o_texts = self.runs_one_by_one(first[~clean], end[~clean])
        order = np.argsort(np.concatenate([r_first, o_first]), kind="stable")
        texts += o_texts
        return (np.concatenate([r_first, o_first])[order], np.concatenate([r_end, o_end])[order],
                [texts[k] for k in order.tolist()])

    def texts(self, first: np.ndarray, end: np.ndarray, whole: str | None) -> list[str]:
        """The texts of runs [first, end) of whole characters: slices of the sample's `whole` text
        where it decoded (its character offsets counted from the bytes), else each run decoded."""
        lo, hi = self.starts_at(first), self.ends[end - 1]
        if whole is not None and len(whole) != len(self.data):
            chars = np.cumsum((np.frombuffer(self.data, np.uint8) & 0xC0) != 0x80)  # characters up to each byte
            lo, hi = np.where(lo > 0, chars[np.maximum(lo - 1, 0)], 0), chars[hi - 1]
        if whole is not None:
            return [whole[p:q] for p, q in zip(lo.tolist(), hi.tolist())]
        return [self.data[p:q].decode() for p, q in zip(lo.tolist(), hi.tolist())]

    def runs_one_by_one(self, first: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """`runs` where the sample's bytes hold invalid UTF-8 or empty tokens: each run split
        exactly (`valid_ranges`)."""
        lo, hi = self.starts_at(first).tolist(), self.starts_at(end).tolist()
        parts = [part for a, b, p, q in zip(first.tolist(), end.tolist(), lo, hi)
                 for part in self.valid_parts(a, b, p, q)]
        return (np.array([a for a, _, _ in parts], dtype=np.int64),
                np.array([b for _, b, _ in parts], dtype=np.int64), [text for _, _, text in parts])

    def run(self, marks: list[int]) -> tuple[torch.Tensor, Alignment]:
        first, end, special, texts, mapped = self.segments(marks)
        encoded = _encode_all(_encoder(self.teacher), texts)
        if mapped:
            in_order, specials = iter(encoded), iter(mapped)
            t_parts = [[next(specials)] if sp else next(in_order) for sp in special.tolist()]
        else:
            t_parts = encoded
        t_spelling = self.teacher.arrays()
        t_ids = np.fromiter(itertools.chain.from_iterable(t_parts), dtype=np.int64)
        t_len = t_spelling.lengths_of(t_ids, "the teacher's encoding")
        t_count = np.fromiter(map(len, t_parts), dtype=np.int64, count=len(t_parts))
        if mapped:
            t_len[np.repeat(special, t_count)] = 1  # a mapped special token: one unit on both sides
        kept = self.spelled_segments(first, end, special, t_ids, t_len, t_count, t_spelling)
        if not kept.all():
            t_keep = np.repeat(kept, t_count)
            t_ids, t_len = t_ids[t_keep], t_len[t_keep]
        units = np.where(self.special, 1, self.lengths)
        kept_before = np.concatenate([np.zeros(1, np.int64), np.cumsum(np.where(self.excluded, 0, units))])
        forced = np.concatenate([np.zeros(1, np.int64), kept_before[np.stack([first[kept], end[kept]], 1).ravel()]])
        forced = forced[np.concatenate([[True], forced[1:] != forced[:-1]])]  # sorted already: drop repeats
        alignment = chunks_from_ends(np.cumsum(units[~self.excluded]), np.cumsum(t_len), forced, self.excluded,
                                     **self.counts)
        return torch.from_numpy(t_ids), alignment

    def spelled_segments(self, first: np.ndarray, end: np.ndarray, special: np.ndarray, t_ids: np.ndarray,
                         t_len: np.ndarray, t_count: np.ndarray, t_spelling: SpellingArrays) -> np.ndarray:
        """Which segments the teacher's encoding spells byte for byte (one comparison when all
        do); a run it does not spell (a normalizer changed its bytes) is excluded."""
        kept = np.ones(first.size, dtype=bool)
        lo, hi = self.starts_at(first), self.starts_at(end)
        runs = ~special
        wanted = b"".join([self.data[p:q] for p, q in zip(lo[runs].tolist(), hi[runs].tolist())])
        r_ids, r_len = t_ids, t_len
        if special.any():
            t_run = np.repeat(runs, t_count)
            r_ids, r_len = t_ids[t_run], t_len[t_run]
        t_sum = np.concatenate([np.zeros(1, np.int64), np.cumsum(t_len)])
        t_end = np.cumsum(t_count)
        if t_spelling.spell(r_ids, r_len) == wanted and \
                np.array_equal((t_sum[t_end] - t_sum[t_end - t_count])[runs], (hi - lo)[runs]):
            return kept  # the joined bytes agree and every run's teacher bytes end where its own do
        for k in np.flatnonzero(runs).tolist():
            part = slice(int(t_end[k] - t_count[k]), int(t_end[k]))
            if t_spelling.spell(t_ids[part], t_len[part]) != self.data[int(lo[k]):int(hi[k])]:
                kept[k] = False
                self.exclude(np.arange(first[k], end[k]), "unspelled")
        return kept
