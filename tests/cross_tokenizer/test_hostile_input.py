"""The cross-tokenizer functions under hostile input: every bad argument is a TypeError /
ValueError naming it and what to pass, raised before any work, the caller's objects unchanged;
nothing is truncated, parsed or wrapped silently (float or string ids, a float boundary, a
stop-token map giving a float, a string or NaN, a corrupt tokenizer.json, too few hidden rows, the
shared vocabulary of the swapped pair, a padded teacher layer, a long cascade of cut characters)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("tokenizers")

from megatron_rl_patches import cross_tokenizer as ct  # noqa: E402
from tests.cross_tokenizer.conftest import TEXTS  # noqa: E402
from tests.cross_tokenizer.test_losses import dense_reference  # noqa: E402

IM_END = 151645  # Qwen's <|im_end|>


@pytest.mark.parametrize("bad,named", [([1, 2.0], r"ids\[1\] is float 2.0"), ([1.7], r"ids\[0\] is float 1.7"),
                                       (["12"], r"ids\[0\] is str '12'"), ([3, None], r"ids\[1\] is NoneType"),
                                       (None, "ids must be a sequence"), ([True], r"ids\[0\] is bool")])
def test_ids_must_be_ints(spm, bad, named):
    with pytest.raises(TypeError, match=named + ".*ints"):
        ct.token_bytes(spm, bad)
    if bad is not None:
        kept = list(bad)
        with pytest.raises(TypeError, match=named.replace("ids", "student_ids", 1)):
            ct.retokenize(bad, spm, spm)
        assert bad == kept
    assert ct.token_bytes(spm, torch.tensor([5, 6])) == ct.token_bytes(spm, [5, 6])  # integer tensors stay served


def test_boundaries_must_be_ints(qwen3, qwen35):
    ids = ct.load_tokenizer(qwen3).encode(TEXTS["english"], add_special_tokens=False).ids
    for bad in ([1.5], [2, "3"], [None]):
        with pytest.raises(TypeError, match=r"boundaries\[\d\] is .*student token indices as ints"):
            ct.retokenize(ids, qwen3, qwen35, boundaries=bad)
        with pytest.raises(TypeError, match=r"boundaries\[\d\] is"):
            ct.align([b"ab", b"c"], [b"a", b"bc"], boundaries=bad)
    t_ids, alignment = ct.retokenize(ids, qwen3, qwen35, boundaries={2})  # a set of ints still served
    assert alignment.student_chunk[2] > alignment.student_chunk[1]


@pytest.mark.parametrize("given", [1.7, "abc", math.nan, float(1)])
def test_stop_tokens_must_give_ints(qwen3, deepseek, given):
    ids = [*ct.load_tokenizer(qwen3).encode("hi", add_special_tokens=False).ids, IM_END]
    with pytest.raises(TypeError, match=rf"stop_tokens \(the hook\) returned .* for student id {IM_END}.*an int, "
                                        "or None"):
        ct.retokenize(ids, qwen3, deepseek, stop_tokens=lambda i: given)
    with pytest.raises(TypeError, match=rf"stop_tokens\[{IM_END}\] is .*an int, or None"):
        ct.retokenize(ids, qwen3, deepseek, stop_tokens={IM_END: given})
    t_ids, _ = ct.retokenize(ids, qwen3, deepseek, stop_tokens={IM_END: np.int64(1)})
    assert t_ids[-1] == 1  # a NumPy integer is an int


def test_corrupt_tokenizer_json_named(tmp_path, spm):
    path = tmp_path / "tokenizer.json"
    path.write_text(spm.to_str()[:200])  # truncated
    for given in (path, tmp_path):
        with pytest.raises(ValueError, match=r"student_tokenizer: '.*tokenizer.json' is not a tokenizer.json .*"
                                             "download or save it again"):
            ct.retokenize([1], given, spm)


def _models(student, teacher, s_rows, t_rows, pad=0, hidden=8):
    g = torch.Generator().manual_seed(0)
    s_vocab = ct.load_tokenizer(student).get_vocab_size() + pad
    t_vocab = ct.load_tokenizer(teacher).get_vocab_size()
    return (torch.randn(s_rows, hidden, generator=g), torch.randn(s_vocab, hidden, generator=g),
            torch.randn(t_rows, hidden, generator=g), torch.randn(t_vocab, hidden, generator=g))


LOSSES = [ct.chunk_start_topk_divergence, ct.chunk_start_full_divergence]


@pytest.mark.parametrize("loss", LOSSES)
def test_hidden_rows_checked_before_any_work(qwen3, deepseek, loss):
    ids = ct.load_tokenizer(qwen3).encode(TEXTS["mixed"], add_special_tokens=False).ids
    t_ids, alignment = ct.retokenize(ids, qwen3, deepseek)
    shared = ct.shared_strings(qwen3, deepseek)
    h, w, th, tw = _models(qwen3, deepseek, len(ids), len(t_ids))
    with pytest.raises(ValueError, match=f"hidden has {len(ids) - 1} rows; the alignment has {len(ids)} student"):
        loss(h[:-1], w, th, tw, alignment, shared)
    with pytest.raises(ValueError, match=f"teacher_hidden has 2 rows; the alignment has {len(t_ids)} teacher"):
        loss(h, w, th[:2], tw, alignment, shared)
    with pytest.raises(ValueError, match="weight .* does not match hidden's hidden size 8"):
        loss(h, w[:, :4], th, tw, alignment, shared)
    assert loss(h, w, th, tw, alignment, shared).shape == (len(ids),)


@pytest.mark.parametrize("loss", LOSSES)
def test_swapped_shared_vocabulary_refused(qwen3, qwen35, loss):
    """Qwen3 (151,851 ids, 85 padded rows) → Qwen3.5 (248,077): the pair's shared vocabulary
    swapped puts Qwen3.5's ids on the student's side (and Qwen3's on the teacher's)."""
    ids = ct.load_tokenizer(qwen3).encode(TEXTS["chinese"], add_special_tokens=False).ids
    t_ids, alignment = ct.retokenize(ids, qwen3, qwen35)
    h, w, th, tw = _models(qwen3, qwen35, len(ids), len(t_ids), pad=85)
    with pytest.raises(ValueError, match="shared: its student side is a vocabulary of 248077 ids but weight has "
                                         "151936 rows; pass shared_strings.student_tokenizer, teacher_tokenizer"):
        loss(h, w, th, tw, alignment, ct.shared_strings(qwen35, qwen3))
    # the reverse pair (Qwen3.5 → Qwen3) given this pair's vocabulary: its teacher's side is refused
    s_ids, reverse = ct.retokenize(t_ids, qwen35, qwen3)
    th, tw, h, w = _models(qwen35, qwen3, len(t_ids), len(s_ids), hidden=8)
    w = torch.cat([w, w[:85]])
    with pytest.raises(ValueError, match="its teacher side is a vocabulary of 248077 ids but teacher_weight has "
                                         "151936"):
        loss(th, tw, h, w, reverse, ct.shared_strings(qwen3, qwen35))


def test_topk_on_a_padded_teacher_layer(spm):
    """Padded teacher rows (Megatron pads the vocabulary) that win the teacher's top-k belong to
    no shared string: they fall into the tail instead of indexing past the string table (or being
    read as the last string): the value equals the float64 dense reference by the definitions."""
    ids = ct.load_tokenizer(spm).encode(TEXTS["english"], add_special_tokens=False).ids
    t_ids, alignment = ct.retokenize(ids, spm, spm)
    shared = ct.shared_strings(spm, spm)
    h, w, th, tw = (t.double() for t in _models(spm, spm, len(ids), len(t_ids)))
    tw = torch.cat([tw, th.mean(0, keepdim=True).expand(4, -1) * 50])  # 4 padded rows, the teacher's favourites
    assert (shared.string_of(torch.arange(tw.size(0) - 4, tw.size(0)), "teacher") == -1).all()
    value = ct.chunk_start_topk_divergence(h, w, th, tw, alignment, shared, k=4)
    rows, ref = dense_reference(h, w, th, tw, alignment, shared, 4, "reverse_kl")
    assert torch.isfinite(value).all() and value.abs().sum() > 0
    torch.testing.assert_close(value, torch.zeros_like(value).index_put((rows,), ref), rtol=1e-7, atol=1e-9)


def test_cascade_of_real_tokens(qwen3, qwen35):
    """A cascade of characters cut by excluded tokens on Qwen3's own ids, `ed | 9e | a4 ed | 9e |
    a4 ed | … | ff`: the stray `ff` cuts the last character, whose excluded token cuts the one
    before, 3,000 rounds (deeper than Python's recursion limit): every token excluded, no
    RecursionError."""
    spelled = ct.token_bytes(qwen3, range(ct.load_tokenizer(qwen3).get_vocab_size()))
    ids = [spelled.index(b"\xed")] + [spelled.index(b"\x9e"), spelled.index(b"\xa4\xed")] * 3000 + [
        spelled.index(b"\xff")]
    t_ids, alignment = ct.retokenize(ids, qwen3, qwen35)
    assert t_ids.numel() == 0 and alignment.invalid_utf8 == len(ids) == alignment.n_excluded
    ids[-1:] = [spelled.index(b"\x9e"), spelled.index(b"\xa4")]  # the last character whole: every token kept
    t_ids, alignment = ct.retokenize(ids, qwen3, qwen35)
    assert alignment.n_excluded == 0
    assert b"".join(ct.token_bytes(qwen35, t_ids)) == b"".join(ct.token_bytes(qwen3, ids)) == "\ud7a4".encode() * 3001
