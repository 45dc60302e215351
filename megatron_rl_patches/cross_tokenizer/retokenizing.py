"""The teacher's own encoding of a student sample's bytes, and their alignment: the text split at
special tokens (mapped to the teacher's, else excluded), forced boundaries and bytes that are not
valid UTF-8 (excluded), each segment encoded with no BOS/EOS and no dummy prefix."""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from megatron_rl_patches.cross_tokenizer.alignment import Alignment, chunks_from_ends
from megatron_rl_patches.cross_tokenizer.arguments import as_index_list, as_int_list, is_int
from megatron_rl_patches.cross_tokenizer.spelling import ByteTable, component_spec, table_of
from megatron_rl_patches.cross_tokenizer.utf8_runs import valid_runs

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
    ids = as_int_list(student_ids, "student_ids")
    student = table_of(student_tokenizer, "student_tokenizer")
    teacher = table_of(teacher_tokenizer, "teacher_tokenizer")
    pieces = student.of(ids, "student_ids")
    n = len(ids)
    marks = sorted(set(as_index_list(boundaries, "boundaries")))
    if any(b < 0 or b > n for b in marks):
        raise ValueError(f"boundaries must be student token indices in [0, {n}], got {marks}")
    if _same(student, teacher):
        chunk = torch.arange(n, dtype=torch.int64)
        same_ids = torch.as_tensor(student_ids, dtype=torch.int64) if isinstance(student_ids, torch.Tensor) \
            else torch.tensor(ids, dtype=torch.int64)
        return same_ids, Alignment(chunk, chunk.clone(), n)
    stop = _stop_map(stop_tokens, student, teacher)
    encoder = _encoder(teacher)
    # per segment O(its tokens) only: Python lists, the arrays built once at the end
    s_len: list[int] = []  # bytes of each kept student token in order (a mapped special: 1 unit)
    excluded = [False] * n
    t_ids: list[int] = []
    t_len: list[int] = []
    forced = [0]
    kept = [0]  # bytes of the kept student tokens so far
    counts = {"invalid_utf8": 0, "unspelled": 0, "unmapped_special": 0}
    mark_set = set(marks)

    def exclude(tokens: list[int], why: str) -> None:
        for i in tokens:
            excluded[i] = True
        counts[why] += len(tokens)

    def encode(run: list[int]) -> None:
        valid, bad = valid_runs(run, pieces)
        exclude(bad, "invalid_utf8")
        for part in valid:
            data = b"".join(pieces[i] for i in part)
            encoded = encoder.encode(data.decode(), add_special_tokens=False).ids
            spelled = teacher.of(encoded, "the teacher's encoding")
            if b"".join(spelled) != data:  # a normalizer changed the bytes: mask the segment
                exclude(part, "unspelled")
                continue
            forced.append(kept[0])
            s_len.extend(len(pieces[i]) for i in part)
            kept[0] += len(data)
            t_ids.extend(encoded)
            t_len.extend(len(p) for p in spelled)
            forced.append(kept[0])

    run: list[int] = []
    for i, token in enumerate(ids):
        if i in mark_set or token in student.special:
            encode(run)
            run = []
        if token in student.special:
            mapped = stop(token)
            if mapped is None:
                exclude([i], "unmapped_special")
                continue
            forced.append(kept[0])
            s_len.append(1)
            kept[0] += 1
            t_ids.append(mapped)
            t_len.append(1)
            forced.append(kept[0])
        else:
            run.append(i)
    encode(run)
    s_ends = np.cumsum(np.asarray(s_len, dtype=np.int64))
    t_ends = np.cumsum(np.asarray(t_len, dtype=np.int64))
    alignment = chunks_from_ends(s_ends, t_ends, np.unique(np.asarray(forced, dtype=np.int64)),
                                 np.asarray(excluded, dtype=bool), **counts)
    return torch.tensor(t_ids, dtype=torch.int64), alignment
