"""The exact core on real tokenizers (Qwen3, Qwen3.5, DeepSeek) and a SentencePiece-style one:
bytes per token, the teacher's own encoding, chunks, invalid UTF-8, special tokens, forced
boundaries, the identity for one tokenizer, and the shared vocabulary."""
from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")

import torch  # noqa: E402

from megatron_rl_patches import cross_tokenizer as ct  # noqa: E402
from tests.cross_tokenizer.conftest import TEXTS, sentencepiece_like  # noqa: E402

PAIRS = [("qwen3", "qwen35"), ("qwen35", "qwen3"), ("qwen3", "deepseek"), ("deepseek", "qwen3"),
         ("qwen3", "spm"), ("spm_never", "qwen35")]


def encode(tokenizer, text: str) -> list[int]:
    return ct.load_tokenizer(tokenizer).encode(text, add_special_tokens=False).ids


def check_chunks(s_bytes, t_bytes, alignment, n_teacher):
    """Chunks contiguous, numbered in order, the same bytes on both sides, ≥ 1 token each, minimal."""
    s_chunk, t_chunk = alignment.student_chunk.tolist(), alignment.teacher_chunk.tolist()
    assert len(t_chunk) == n_teacher and alignment.n_chunks >= 0
    kept = [c for c in s_chunk if c >= 0]
    assert kept == sorted(kept) and t_chunk == sorted(t_chunk)
    assert set(kept) == set(t_chunk) == set(range(alignment.n_chunks))
    for j in range(alignment.n_chunks):
        s = [b for b, c in zip(s_bytes, s_chunk) if c == j]
        t = [b for b, c in zip(t_bytes, t_chunk) if c == j]
        assert b"".join(s) == b"".join(t)
        s_ends = {sum(map(len, s[:k + 1])) for k in range(len(s) - 1)}
        t_ends = {sum(map(len, t[:k + 1])) for k in range(len(t) - 1)}
        assert not (s_ends & t_ends), f"chunk {j} is not minimal"


@pytest.mark.parametrize("name", ["qwen3", "qwen35", "deepseek", "spm_never"])
def test_token_bytes_spell_the_text(name, request):
    tok = request.getfixturevalue(name)
    for text in TEXTS.values():
        assert b"".join(ct.token_bytes(tok, encode(tok, text))) == text.encode()


def test_sentencepiece_pieces(spm):
    """`▁` is a space, `<0xNN>` its byte, the dummy prefix the first token's leading space."""
    table = ct.load_tokenizer(spm).get_vocab()
    assert ct.token_bytes(spm, [table["<0xF0>"], table["<0x61>"], table["a"]]) == [b"\xf0", b"a", b"a"]
    ids = encode(spm, "hello 🦀 world")
    assert b"".join(ct.token_bytes(spm, ids)) == " hello 🦀 world".encode()
    assert any(ct.token_bytes(spm, [i])[0] == b"\xf0" for i in ids)  # the crab is not in the vocabulary


@pytest.mark.parametrize("student,teacher", PAIRS)
def test_retokenize_is_the_teachers_encoding(student, teacher, request):
    s_tok, t_tok = request.getfixturevalue(student), request.getfixturevalue(teacher)
    never = t_tok
    if teacher == "spm":  # the same vocabulary, encoding with no dummy prefix
        from tokenizers import Tokenizer, pre_tokenizers
        never = Tokenizer.from_str(t_tok.to_str())
        never.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    for text in TEXTS.values():
        ids = encode(s_tok, text)
        t_ids, alignment = ct.retokenize(torch.tensor(ids), s_tok, t_tok)
        assert t_ids.dtype == torch.int64
        assert t_ids.tolist() == encode(never, text)  # no BOS/EOS, no dummy prefix
        assert alignment.n_excluded == 0
        check_chunks(ct.token_bytes(s_tok, ids), ct.token_bytes(t_tok, t_ids), alignment, len(t_ids))


def test_one_tokenizer_is_the_identity(qwen3):
    ids = encode(qwen3, " hello") + encode(qwen3, " world")  # not the canonical encoding of the text
    assert ids != encode(qwen3, " hello world") or True
    given = torch.tensor(ids)
    t_ids, alignment = ct.retokenize(given, qwen3, qwen3)
    assert t_ids is given
    assert alignment.student_chunk.tolist() == alignment.teacher_chunk.tolist() == list(range(len(ids)))


def test_invalid_utf8_inside_and_at_the_end(qwen3, qwen35):
    text = "价格：10元"
    raw = text.encode()
    vocab = ct.load_tokenizer(qwen3).get_vocab()
    table = {ct.token_bytes(qwen3, [i])[0]: i for i in vocab.values()}
    cut = encode(qwen3, "ok ") + [table[b"\xe4"], table[b"\xbb"]] + encode(qwen3, " fine ") + [table[raw[:1]]]
    stray = [table[b"\xff"]] if b"\xff" in table else []
    ids = cut[:2] + stray + cut[2:]
    t_ids, alignment = ct.retokenize(ids, qwen3, qwen35)
    s_bytes = ct.token_bytes(qwen3, ids)
    assert alignment.invalid_utf8 == alignment.n_excluded == 3 + len(stray)
    assert alignment.student_chunk[-1] == -1
    kept = [b for b, c in zip(s_bytes, alignment.student_chunk.tolist()) if c >= 0]
    assert b"".join(ct.token_bytes(qwen35, t_ids)) == b"".join(kept)
    assert t_ids.tolist() == encode(qwen35, "ok ") + encode(qwen35, " fine ")
    check_chunks([b for b, c in zip(s_bytes, alignment.student_chunk.tolist()) if c >= 0],
                 ct.token_bytes(qwen35, t_ids),
                 type(alignment)(alignment.student_chunk[alignment.student_chunk >= 0], alignment.teacher_chunk,
                                 alignment.n_chunks), len(t_ids))


def test_special_tokens_map_by_content_or_table_else_excluded(qwen3, qwen35, deepseek):
    ids = encode(qwen3, "Hi there<|im_end|>")
    end = ct.load_tokenizer(qwen3).token_to_id("<|im_end|>")
    assert ids[-1] == end
    t_ids, alignment = ct.retokenize(ids, qwen3, qwen35)
    assert t_ids[-1] == ct.load_tokenizer(qwen35).token_to_id("<|im_end|>")
    last = alignment.n_chunks - 1
    assert alignment.student_chunk[-1] == last and alignment.teacher_chunk[-1] == last
    t_ids, alignment = ct.retokenize(ids, qwen3, deepseek)
    assert alignment.unmapped_special == 1 and alignment.student_chunk[-1] == -1
    ds_end = ct.load_tokenizer(deepseek).token_to_id("<｜end▁of▁sentence｜>")
    for table in ({end: ds_end}, lambda i: ds_end if i == end else None):
        t_ids, alignment = ct.retokenize(ids, qwen3, deepseek, stop_tokens=table)
        assert t_ids[-1] == ds_end and alignment.unmapped_special == 0
        assert (alignment.student_chunk == alignment.n_chunks - 1).sum() == 1
    with pytest.raises(ValueError, match="stop_tokens maps"):
        ct.retokenize(ids, qwen3, deepseek, stop_tokens={end: 10**7})


def test_forced_boundaries(qwen3, qwen35):
    ids = encode(qwen3, "tool output: 12345 done")
    for mark in range(1, len(ids)):
        t_ids, alignment = ct.retokenize(ids, qwen3, qwen35, boundaries=[mark])
        assert alignment.student_chunk[mark] != alignment.student_chunk[mark - 1]
        check_chunks(ct.token_bytes(qwen3, ids), ct.token_bytes(qwen35, t_ids), alignment, len(t_ids))
    with pytest.raises(ValueError, match="boundaries"):
        ct.retokenize(ids, qwen3, qwen35, boundaries=[len(ids) + 1])


def test_normalizer_spans_are_masked_and_counted(qwen3, spm_never):
    nfc = sentencepiece_like("never", nfc=True)
    ids = encode(qwen3, "cafe\u0301 ok")  # decomposed é: NFC changes the bytes
    t_ids, alignment = ct.retokenize(ids, qwen3, nfc)
    assert alignment.unspelled == len(ids) == alignment.n_excluded and t_ids.numel() == 0
    t_ids, alignment = ct.retokenize(ids, qwen3, spm_never)  # the same without the normalizer
    assert alignment.n_excluded == 0 and t_ids.numel() > 0


@pytest.mark.parametrize("student,teacher", [("qwen3", "qwen35"), ("qwen3", "deepseek"), ("spm", "qwen3")])
def test_shared_vocabulary_exact_and_complete(student, teacher, request):
    s_tok, t_tok = request.getfixturevalue(student), request.getfixturevalue(teacher)
    s_ids, t_ids = ct.shared_vocabulary(s_tok, t_tok)
    assert s_ids.dtype == t_ids.dtype == torch.int64 and s_ids.shape == t_ids.shape
    s_table = ct.token_bytes(s_tok, range(ct.load_tokenizer(s_tok).get_vocab_size()))
    t_table = ct.token_bytes(t_tok, range(ct.load_tokenizer(t_tok).get_vocab_size()))
    assert all(s_table[a] == t_table[b] for a, b in zip(s_ids.tolist(), t_ids.tolist()))
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in enumerate(t_table):
        by_bytes.setdefault(b, []).append(i)
    expected = sorted((a, b) for a, piece in enumerate(s_table) if piece for b in by_bytes.get(piece, []))
    assert list(zip(s_ids.tolist(), t_ids.tolist())) == expected


def test_align_refuses_different_bytes():
    with pytest.raises(ValueError, match="same bytes"):
        ct.align([b"ab"], [b"a", b"c"])
    with pytest.raises(TypeError, match="student_bytes"):
        ct.align(b"ab", [b"ab"])
    assert ct.align([b"a", b"bc"], [b"ab", b"c"]).student_chunk.tolist() == [0, 0]
