"""The exact bytes of every token id of a tokenizer: byte-level BPE through the byte↔unicode
table, byte-fallback `<0xNN>` tokens their byte, SentencePiece's `▁` a space, added and special
tokens their content. One table per tokenizer, built once and kept."""
from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron_rl_patches.cross_tokenizer.arguments import as_int_list
from megatron_rl_patches.cross_tokenizer.loading import load_tokenizer

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_KEPT = 16  # tables kept (each holds its tokenizer alive, so an id() is never reused)


def unicode_to_byte() -> dict[str, int]:
    """The inverse of byte-level BPE's byte→printable-character table (GPT-2's convention):
    printable Latin-1 bytes stand for themselves, the others for chr(256 + n) in byte order."""
    direct = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in direct}
    shifted = 0
    for b in range(256):
        if b not in table.values():
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


@dataclass
class ByteTable:
    """Bytes of every id (None: an id the tokenizer does not have), the ids of its special added
    tokens, and each special token's content → id."""

    tokenizer: Any
    spelled: list[bytes | None]
    special: frozenset[int]
    special_by_content: dict[str, int] = field(default_factory=dict)
    # what other modules derive from this table and another (keyed by id, the other kept alive)
    derived: dict[tuple[str, int], tuple[Any, Any]] = field(default_factory=dict, repr=False)

    def cached(self, kind: str, other: Any, make: Any) -> Any:
        """`make()` computed once per (kind, other object) for this table."""
        key = (kind, id(other))
        if key not in self.derived:
            self.derived[key] = (other, make())
        return self.derived[key][1]

    def of(self, ids: Iterable[int], name: str = "ids") -> list[bytes]:
        out = []
        size = len(self.spelled)
        for i in ids:
            value = self.spelled[i] if 0 <= i < size else None
            if value is None:
                raise unknown_id(name, i, size)
            out.append(value)
        return out

    def arrays(self) -> SpellingArrays:
        """The table as arrays (built once): what a whole sample needs without a loop per token."""
        return self.cached("arrays", None, lambda: SpellingArrays.of(self))


def unknown_id(name: str, token: int, size: int) -> ValueError:
    return ValueError(f"{name}: id {token} is not in the tokenizer's vocabulary (size {size}); pass ids of the "
                      "tokenizer they were produced with")


@dataclass(frozen=True)
class SpellingArrays:
    """Every id's bytes laid end to end (`data`), each id's offset and length (−1: no such id) and
    whether it is a special token."""

    data: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    special: np.ndarray

    @classmethod
    def of(cls, table: ByteTable) -> SpellingArrays:
        lengths = np.fromiter((-1 if p is None else len(p) for p in table.spelled), dtype=np.int64,
                              count=len(table.spelled))
        data = np.frombuffer(b"".join(p for p in table.spelled if p is not None), dtype=np.uint8)
        starts = np.cumsum(np.maximum(lengths, 0)) - np.maximum(lengths, 0)
        special = np.zeros(lengths.size, dtype=bool)
        special[list(table.special)] = True
        return cls(data, starts, lengths, special)

    def lengths_of(self, ids: np.ndarray, name: str) -> np.ndarray:
        """The byte length of each id; a ValueError naming `name` and the first id the table lacks."""
        size = self.lengths.size
        inside = (ids >= 0) & (ids < size)
        found = self.lengths[np.where(inside, ids, 0)]
        bad = ~inside | (found < 0)
        if bad.any():
            raise unknown_id(name, int(ids[np.argmax(bad)]), size)
        return found

    def spell(self, ids: np.ndarray, lengths: np.ndarray) -> bytes:
        """The bytes of `ids` (known ids, `lengths` theirs) joined."""
        ends = np.cumsum(lengths)
        if not ends.size or not ends[-1]:
            return b""
        shift = np.repeat(self.starts[ids] - (ends - lengths), lengths)
        return self.data[np.arange(int(ends[-1]), dtype=np.int64) + shift].tobytes()


def _kinds(node: Any) -> list[dict]:
    """Every component of a (possibly Sequence) pre-tokenizer / decoder spec."""
    if not isinstance(node, dict):
        return []
    inner = node.get("decoders") or node.get("pretokenizers") or []
    return [node, *(part for child in inner for part in _kinds(child))]


def component_spec(component: Any) -> Any:
    """A tokenizer component's JSON spec (None when absent)."""
    return None if component is None else json.loads(component.__getstate__())


def _byte_level_translation() -> dict[int, int]:
    """str.translate table: byte-level BPE's stand-in character → the Latin-1 character of its byte."""
    return {ord(ch): b for ch, b in unicode_to_byte().items()}


def _spell_model_token(piece: str, byte_level: dict[int, int] | None, fallback: bool, metaspace: str | None) -> bytes:
    if byte_level is not None:
        try:
            return piece.translate(byte_level).encode("latin-1")
        except UnicodeEncodeError:
            return piece.encode()  # a piece outside the table (rare; written as text)
    if fallback:
        hit = _BYTE_FALLBACK.fullmatch(piece)
        if hit:
            return bytes([int(hit.group(1), 16)])
    if metaspace:
        piece = piece.replace(metaspace, " ")
    return piece.encode()


def build_table(tokenizer: Any) -> ByteTable:
    """The byte table of one `tokenizers.Tokenizer` (read from its model, pre-tokenizer and decoder)."""
    parts = _kinds(component_spec(tokenizer.decoder)) + _kinds(component_spec(tokenizer.pre_tokenizer))
    types = {p.get("type") for p in parts}
    model = type(tokenizer.model).__name__
    if model not in ("BPE", "Unigram", "WordLevel"):
        raise ValueError(f"cross_tokenizer: a {model} tokenizer model is not supported (its pieces do not spell "
                         "bytes: WordPiece's ## continuation); use a BPE, Unigram or WordLevel tokenizer")
    byte_level = _byte_level_translation() if "ByteLevel" in types else None
    fallback = bool(getattr(tokenizer.model, "byte_fallback", False)) or "ByteFallback" in types
    metaspace = None
    for p in parts:
        if p.get("type") == "Metaspace":
            metaspace = p.get("replacement", "▁")
        if p.get("type") == "Replace" and p.get("content") == " ":
            metaspace = (p.get("pattern") or {}).get("String", metaspace)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    added = tokenizer.get_added_tokens_decoder()
    size = max([*vocab.values(), *added.keys(), -1]) + 1
    spelled: list[bytes | None] = [None] * size
    for piece, i in vocab.items():
        spelled[i] = _spell_model_token(piece, byte_level, fallback, metaspace)
    for i, token in added.items():
        spelled[i] = token.content.encode()
    special = frozenset(i for i, token in added.items() if token.special)
    return ByteTable(tokenizer, spelled, special, {added[i].content: i for i in special})


_TABLES: dict[int, ByteTable] = {}


def table_of(tokenizer: Any, name: str = "tokenizer") -> ByteTable:
    """The (cached) byte table of a tokenizer argument."""
    tok = load_tokenizer(tokenizer, name)
    table = _TABLES.get(id(tok))
    if table is None:
        if len(_TABLES) >= _KEPT:
            _TABLES.pop(next(iter(_TABLES)))
        table = _TABLES[id(tok)] = build_table(tok)
    return table


def token_bytes(tokenizer: Any, ids: Sequence[int] | Any) -> list[bytes]:
    """The exact bytes of each id: joined, a sequence's ids spell its text (SentencePiece's dummy
    prefix, which a decoder strips at a text's start, stays the first token's leading space)."""
    return table_of(tokenizer).of(as_int_list(ids))
