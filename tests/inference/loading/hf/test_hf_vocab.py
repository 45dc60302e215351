"""The vocabulary of a Hugging Face teacher: its config.json vocab_size (and tokenizer.json ids,
where teacher and student both have one) must be the student's, refused naming both otherwise;
Megatron's padding rows beyond vocab_size never receive probability mass in the log-prob, top-k
and divergence ops, however large their logits (the padding of a converted checkpoint is zeros,
here it is made the largest logit of every row)."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_rl_patches import (
    check_teacher_vocab,
    lm_head_divergence,
    lm_head_log_probs_and_entropy,
    lm_head_topk_ids,
    lm_head_topk_logprobs,
    log_probs_and_entropy,
    topk_ids,
    topk_logprobs,
)
from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config

REAL, PADDED, HIDDEN, ROWS = 1001, 1024, 16, 24


def _checkpoint(path, vocab_size=REAL, tokens=None):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(tiny_hf_config("qwen3", vocab_size=vocab_size)))
    if tokens is not None:
        (path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": tokens},
                                                         "added_tokens": [{"id": 9, "content": "<eos>"}]}))
    return path


def test_matching_vocab_returns_the_shared_size(tmp_path):
    teacher = _checkpoint(tmp_path / "teacher", tokens={"a": 0, "b": 1})
    student = _checkpoint(tmp_path / "student", tokens={"a": 0, "b": 1})
    assert check_teacher_vocab(teacher, student) == 10  # both tokenizers: theirs (ids 0, 1 and <eos> 9)
    assert check_teacher_vocab(teacher, REAL) == REAL
    assert check_teacher_vocab(teacher, _checkpoint(tmp_path / "untokenized")) == REAL  # one tokenizer: sizes only


def test_vocab_size_mismatch_names_both(tmp_path):
    teacher = _checkpoint(tmp_path / "teacher")
    student = _checkpoint(tmp_path / "student", vocab_size=1000)
    with pytest.raises(ValueError, match=r"vocab_size=1001.*student.*student.*vocab_size=1000"):
        check_teacher_vocab(teacher, student)
    with pytest.raises(ValueError, match=r"teacher .*teacher.* vocab_size=1001 .* vocab_size=151936"):
        check_teacher_vocab(teacher, 151936)


def test_one_tokenizer_with_other_padded_vocab_sizes_is_served_both_ways(tmp_path):
    """Qwen2.5-32B (vocab_size 152064) teaching Qwen2.5-1.5B (151936), one tokenizer: the shared real
    vocabulary is the tokenizer's (ids 0..9 here), in either argument order."""
    tokens = {f"t{i}": i for i in range(9)}
    big = _checkpoint(tmp_path / "big", vocab_size=1024, tokens=tokens)
    small = _checkpoint(tmp_path / "small", vocab_size=REAL, tokens=tokens)
    assert check_teacher_vocab(big, small) == 10  # 9 model tokens + the added <eos> (id 9)
    assert check_teacher_vocab(small, big) == 10
    assert check_teacher_vocab(big, _checkpoint(tmp_path / "same", vocab_size=1024, tokens=tokens)) == 10
    # without a tokenizer.json on one side the sizes decide, as before
    with pytest.raises(ValueError, match=r"vocab_size=1024.*vocab_size=1001"):
        check_teacher_vocab(big, _checkpoint(tmp_path / "untokenized"))
    with pytest.raises(ValueError, match=r"vocab_size=1024.*vocab_size=1001"):
        check_teacher_vocab(big, REAL)


def test_other_tokenizer_with_other_padded_vocab_size_stays_refused(tmp_path):
    teacher = _checkpoint(tmp_path / "teacher", vocab_size=1024, tokens={"a": 0, "b": 1})
    student = _checkpoint(tmp_path / "student", tokens={"a": 0, "c": 1})
    with pytest.raises(ValueError, match=r"differ on 2 token\(s\)"):
        check_teacher_vocab(teacher, student)


def test_tokenizer_ids_mismatch_names_the_tokens(tmp_path):
    teacher = _checkpoint(tmp_path / "teacher", tokens={"a": 0, "b": 1})
    student = _checkpoint(tmp_path / "student", tokens={"a": 1, "b": 0})
    with pytest.raises(ValueError, match=r"differ on 2 token\(s\) \('a': teacher 0, student 1"):
        check_teacher_vocab(teacher, student)


@pytest.mark.parametrize(("value", "error"), [(True, TypeError), (0, ValueError), (1.5, TypeError)])
def test_bad_student_is_refused(tmp_path, value, error):
    with pytest.raises(error, match="student"):
        check_teacher_vocab(_checkpoint(tmp_path / "teacher"), value)


def test_missing_teacher_config_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"teacher .* has no config.json"):
        check_teacher_vocab(tmp_path, REAL)


@pytest.mark.parametrize("size", [0, -5])
def test_a_non_positive_vocab_size_in_both_configs_is_refused(tmp_path, size):
    """Equal in both, yet no vocabulary: never returned as the shared size."""
    teacher = _checkpoint(tmp_path / "teacher", vocab_size=size)
    student = _checkpoint(tmp_path / "student", vocab_size=size)
    with pytest.raises(ValueError, match=rf"teacher .*: config.json.s vocab_size must be positive, got {size}"):
        check_teacher_vocab(teacher, student)


@pytest.mark.parametrize(("tokenizer", "match"), [
    ([], r"tokenizer.json' is a JSON list, not a tokenizer.json object"),
    ({"model": {"vocab": {"a": 0}}, "added_tokens": [{"id": 9}]},
     r"field added_tokens\[0\] must be an object with a string content and an int id, got \{'id': 9\}"),
    ({"model": {"vocab": {"a": 0}}, "added_tokens": [{"id": "9", "content": "x"}]}, r"field added_tokens\[0\]"),
    ({"model": {"vocab": [3, 4]}}, r"field model.vocab is neither token -> id nor a list"),
])
def test_a_malformed_tokenizer_json_is_named(tmp_path, tokenizer, match):
    teacher = _checkpoint(tmp_path / "teacher", tokens={"a": 0})
    student = _checkpoint(tmp_path / "student", tokens={"a": 0})
    (teacher / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match=match) as caught:
        check_teacher_vocab(teacher, student)
    assert str(teacher) in str(caught.value)


def _padded(seed):
    """hidden [T, H] and a weight [1024, H] whose 23 padding rows give every row its largest logit."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, HIDDEN, generator=gen, dtype=torch.float64)
    weight = torch.randn(PADDED, HIDDEN, generator=gen, dtype=torch.float64) * 0.3
    hidden[:, 0] = 1.0  # a constant feature the padding rows weigh heavily: logit 40 in every row
    weight[REAL:] = 0.0
    weight[REAL:, 0] = 40.0
    return hidden, weight


def test_padding_rows_get_no_probability_mass():
    hidden, weight = _padded(0)
    _, teacher_weight = _padded(1)
    real = weight[:REAL]
    tokens = torch.randint(0, REAL, (ROWS,), generator=torch.Generator().manual_seed(2))
    assert (hidden @ weight.T).argmax(-1).min() >= REAL  # without vocab_size the padding would win

    def pairs(vocab_size, w, tw):
        logits = hidden @ w.T
        ids = torch.arange(8).expand(ROWS, 8)
        return {
            "logits log-probs": log_probs_and_entropy(logits, tokens, with_entropy=True, vocab_size=vocab_size),
            "fused log-probs": lm_head_log_probs_and_entropy(hidden, w, tokens, with_entropy=True,
                                                             vocab_size=vocab_size),
            "top-k ids": (topk_ids(logits, 5, vocab_size=vocab_size),
                          lm_head_topk_ids(hidden, w, 5, vocab_size=vocab_size)),
            "top-k log-probs": (topk_logprobs(logits, ids, vocab_size=vocab_size),
                                lm_head_topk_logprobs(hidden, w, ids, vocab_size=vocab_size)),
            "divergence": (lm_head_divergence(hidden, w, hidden, tw, divergence="jsd", vocab_size=vocab_size),),
        }

    with torch.no_grad():
        padded = pairs(REAL, weight, teacher_weight)
        unpadded = pairs(None, real, teacher_weight[:REAL])
        unmasked = pairs(None, weight, teacher_weight)  # the negative control: padding counted
    flat = [torch.utils._pytree.tree_leaves(case) for case in (padded, unpadded, unmasked)]
    for got, want, wrong in zip(*flat):
        assert torch.allclose(got.double(), want.double(), rtol=0, atol=1e-12)
        assert not torch.allclose(wrong.double(), want.double(), rtol=0, atol=1e-3)
