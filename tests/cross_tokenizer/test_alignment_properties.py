"""Properties of `align` on random splits of random bytes, of `retokenize` on random text
(Qwen3 → Qwen3.5), and of `spread_chunk_log_probs`: chunks contiguous, the same bytes on both
sides, minimal; 1:1 chunks exact; chunk sums exact; tokens of chunk −1 add nothing."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl_patches.cross_tokenizer.alignment import Alignment, align
from megatron_rl_patches.cross_tokenizer.spreading import spread_chunk_log_probs
from tests.cross_tokenizer.test_alignment_real import check_chunks


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    marks = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in zip(marks, marks[1:])]


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=1, max_size=40), st.lists(st.integers(0, 40), max_size=20),
       st.lists(st.integers(0, 40), max_size=20))
def test_align_on_random_splits(data, s_cuts, t_cuts):
    s, t = split(data, s_cuts), split(data, t_cuts)
    alignment = align(s, t)
    check_chunks(s, t, alignment, len(t))
    common = {sum(map(len, s[:k])) for k in range(len(s) + 1)} & {sum(map(len, t[:k])) for k in range(len(t) + 1)}
    assert alignment.n_chunks == len(common) - 1


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_spread_sums_and_one_to_one(data):
    n_s, n_t = data.draw(st.integers(1, 12)), data.draw(st.integers(1, 12))
    n = data.draw(st.integers(1, min(n_s, n_t)))
    s_chunk = sorted(data.draw(st.lists(st.integers(0, n - 1), min_size=n_s, max_size=n_s)))
    t_chunk = sorted(data.draw(st.lists(st.integers(0, n - 1), min_size=n_t, max_size=n_t)))
    s_chunk[:n], t_chunk[:n] = list(range(n)), list(range(n))  # every chunk has ≥ 1 token each side
    s_chunk, t_chunk = sorted(s_chunk), sorted(t_chunk)
    dropped = data.draw(st.lists(st.integers(0, n_s - 1), max_size=2))
    chunk = torch.tensor(s_chunk)
    alive = [c for c in range(n) if (chunk == c).sum() > sum(s_chunk[d] == c for d in set(dropped))]
    chunk[list(set(dropped))] = -1
    if not alive or set(chunk[chunk >= 0].tolist()) != set(range(n)):
        return
    alignment = Alignment(chunk, torch.tensor(t_chunk), n)
    ls = -torch.rand(n_s, dtype=torch.float32) * 5
    lt = -torch.rand(n_t, dtype=torch.float32) * 5
    ls.requires_grad_()
    out = spread_chunk_log_probs(ls, lt, alignment)
    assert out.dtype == ls.dtype and not out.requires_grad
    for j in range(n):
        mine = chunk == j
        teacher_sum = lt[torch.tensor(t_chunk) == j].double().sum()
        torch.testing.assert_close(out[mine].double().sum(), teacher_sum, rtol=1e-6, atol=1e-5)
        if mine.sum() == 1:
            assert out[mine].item() == teacher_sum.float().item()  # bit-exact
    assert torch.equal(out[chunk < 0], ls.detach()[chunk < 0])


def test_spread_refuses_misshapen_input():
    alignment = Alignment(torch.tensor([0, 0]), torch.tensor([0]), 1)
    with pytest.raises(ValueError, match="student_log_probs"):
        spread_chunk_log_probs(torch.zeros(3), torch.zeros(1), alignment)
    with pytest.raises(TypeError, match="teacher_log_probs"):
        spread_chunk_log_probs(torch.zeros(2), [0.0], alignment)


ALPHABET = st.sampled_from(list("ab xyz.,\n\t  ") + list("的一是了机器") + ["🚀", "é", "👩‍💻", "\u0301"])


@settings(max_examples=25, deadline=None)
@given(st.lists(ALPHABET, min_size=1, max_size=30).map("".join))
def test_retokenize_on_random_text(qwen3, qwen35, text):
    from megatron_rl_patches import cross_tokenizer as ct

    ids = ct.load_tokenizer(qwen3).encode(text, add_special_tokens=False).ids
    t_ids, alignment = ct.retokenize(ids, qwen3, qwen35)
    assert t_ids.tolist() == ct.load_tokenizer(qwen35).encode(text, add_special_tokens=False).ids
    check_chunks(ct.token_bytes(qwen3, ids), ct.token_bytes(qwen35, t_ids), alignment, len(t_ids))
    assert alignment.n_chunks == len(align(ct.token_bytes(qwen3, ids), ct.token_bytes(qwen35, t_ids)).student_chunk
                                     .unique())


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 151_642), min_size=1, max_size=25))
def test_retokenize_random_ids_keeps_exactly_the_valid_bytes(qwen3, deepseek, ids):
    """Any student ids (tokens ending inside characters, stray continuation bytes): the kept
    tokens' bytes are valid UTF-8 and are what the teacher's ids spell, piece by piece."""
    from megatron_rl_patches import cross_tokenizer as ct

    t_ids, alignment = ct.retokenize(ids, qwen3, deepseek)
    s_bytes = ct.token_bytes(qwen3, ids)
    chunk = alignment.student_chunk.tolist()
    kept = [b for b, c in zip(s_bytes, chunk) if c >= 0]
    assert b"".join(kept) == b"".join(ct.token_bytes(deepseek, t_ids))
    assert alignment.n_excluded == alignment.invalid_utf8 + alignment.unspelled + alignment.unmapped_special
    assert alignment.unmapped_special == 0
    whole = b"".join(s_bytes)
    try:
        whole.decode()
        assert alignment.n_excluded == 0
    except UnicodeDecodeError:
        assert alignment.invalid_utf8 > 0
    runs, current = [], []  # the kept tokens between excluded ones: each valid UTF-8
    for b, c in zip(s_bytes, chunk):
        if c < 0:
            runs.append(current)
            current = []
        else:
            current.append(b)
    for run in [*runs, current]:
        b"".join(run).decode()
    kept_chunks = Alignment(alignment.student_chunk[alignment.student_chunk >= 0], alignment.teacher_chunk,
                            alignment.n_chunks)
    check_chunks(kept, ct.token_bytes(deepseek, t_ids), kept_chunks, len(t_ids))
