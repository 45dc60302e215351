"""slime_opd's teachers with another tokenizer, the parts that need no slime: the entry option,
each sample re-tokenized on the whole sequence and cut to the responses, the teacher's micro-batches
under the student's token budget, and the values brought back to the student's rows, against part
1's single-sample definitions (`chunk_start_topk_divergence`, `chunk_reverse_kl`) on real tokenizers."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("tokenizers")

from megatron_rl_patches import cross_tokenizer as xt  # noqa: E402
from megatron_rl_patches.cross_tokenizer import teacher_passes as ct  # noqa: E402
from megatron_rl_patches.integrations.megatron.opd.opd_settings import opd_settings  # noqa: E402
from megatron_rl_patches.ops.lm_head import (  # noqa: E402
    lm_head_log_probs_and_entropy,
    lm_head_topk_ids,
    lm_head_topk_logprobs,
)
from megatron_rl_patches.ops.topk import topk_kl  # noqa: E402
from tests.cross_tokenizer import conftest as tokenizers  # noqa: E402
from tests.cross_tokenizer.conftest import TEXTS  # noqa: E402

qwen3, deepseek = tokenizers.qwen3, tokenizers.deepseek  # part 1's real-tokenizer fixtures

H, K = 8, 4


def test_entry_option_own_tokenizer():
    env = {"MEGATRON_RL_PATCHES_OPD_TEACHERS": "/ckpt/a, /ckpt/qwen35;tokenizer=own"}
    a, b = opd_settings(env).teachers
    assert (a.path, a.own_tokenizer) == ("/ckpt/a", False)
    assert (b.path, b.own_tokenizer, b.provider) == ("/ckpt/qwen35", True, None)
    with pytest.raises(ValueError, match="unknown option 'tokenizer=mine'.*tokenizer=own"):
        opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": "/ckpt/a;tokenizer=mine"})
    with pytest.raises(ValueError, match="Hugging Face directories"):
        opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": "/ckpt/a@m:f;tokenizer=own"})


def test_entry_option_stop_tokens():
    env = {"MEGATRON_RL_PATCHES_OPD_TEACHERS": "/ckpt/t;tokenizer=own;stop_tokens=my_maps:qwen_to_deepseek"}
    (teacher,) = opd_settings(env).teachers
    assert (teacher.own_tokenizer, teacher.stop_tokens) == (True, "my_maps:qwen_to_deepseek")
    with pytest.raises(ValueError, match="add ';tokenizer=own'"):
        opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": "/ckpt/t;stop_tokens=my_maps:f"})
    with pytest.raises(ValueError, match="unknown option 'stop_tokens=not a function'"):
        opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": "/ckpt/t;tokenizer=own;stop_tokens=not a function"})



@pytest.mark.parametrize("entry,named", [("/ckpt/t;tokenizer=own;stop_tokens=a:f;stop_tokens=b:g", "stop_tokens"),
                                         ("/ckpt/t;tokenizer=own; tokenizer=own", "tokenizer")])
def test_entry_option_given_twice_refused(entry, named):
    """An option repeated in one entry is refused by name (the last one won silently)."""
    with pytest.raises(ValueError, match=f"entry '{entry}': option '{named}' given twice; give each option once"):
        opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": entry})


END_OF_SENTENCE = 1  # DeepSeek's <｜end▁of▁sentence｜>


def end_of_turn(student_id: int) -> int | None:
    """A user's stop-token map: Qwen's <|im_end|> (151645) is DeepSeek's end of sentence."""
    return END_OF_SENTENCE if student_id == 151645 else None


def test_stop_token_map_loaded_and_honoured(qwen3, deepseek, tmp_path):
    from types import SimpleNamespace

    from megatron_rl_patches.integrations.megatron.opd import cross_passes
    from megatron_rl_patches.integrations.megatron.opd.opd_settings import Teacher

    qwen3.save(str(tmp_path / "tokenizer.json"))
    args = SimpleNamespace(hf_checkpoint=str(tmp_path))
    spec = f"{__name__}:end_of_turn"
    tokens, response, mask = _sample(qwen3, "Q: hi\n", "Hello there.<|im_end|>")
    data = {"tokens": [tokens], "response_lengths": [response], "loss_masks": [mask]}
    for stop, last, unmapped in ((spec, END_OF_SENTENCE, 0), (None, None, 1)):
        teacher = cross_passes.load_cross(args, Teacher(str(deepseek), own_tokenizer=True, stop_tokens=stop), "tag")
        (sample,) = cross_passes.teacher_samples(data, teacher.pair)
        assert sample.alignment.unmapped_special == unmapped
        assert (int(sample.tokens[-1]) == END_OF_SENTENCE) == (last is not None)
        assert (int(sample.alignment.student_chunk[-1]) >= 0) == (last is not None)  # else masked, counted
    with pytest.raises(ValueError, match="stop_tokens 'no_such_module:f' cannot be loaded"):
        cross_passes.load_cross(args, Teacher(str(deepseek), own_tokenizer=True, stop_tokens="no_such_module:f"),
                                "tag")


def test_check_teacher_vocab_says_how_to_ask(tmp_path):
    """The core check names its arguments and the cross-tokenizer route; slime's OPD teachers add
    how their entry asks for it (issue 64: the core named slime's variable); a role adds nothing."""
    from megatron_rl_patches.inference.loading.hf.vocab import check_teacher_vocab
    from megatron_rl_patches.integrations.megatron.opd.hf_teachers import check_vocab

    for name, size in (("t", 100), ("s", 64)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(f'{{"vocab_size": {size}}}')
    teacher, student = str(tmp_path / "t"), str(tmp_path / "s")
    with pytest.raises(ValueError, match="teacher .* has vocab_size=100 but the student .*megatron_rl_patches"
                                         r"\.cross_tokenizer") as core:
        check_teacher_vocab(teacher, student)
    assert "MEGATRON_RL_PATCHES" not in str(core.value) and "tokenizer=own" not in str(core.value)
    what = f"MEGATRON_RL_PATCHES_OPD_TEACHERS: teacher {teacher!r}"
    with pytest.raises(ValueError, match=r"^MEGATRON_RL_PATCHES_OPD_TEACHERS: teacher .* or in MEGATRON_RL_PATCHES_"
                                         r"OPD_TEACHERS ask for it with the entry '.*t;tokenizer=own'$"):
        check_vocab(teacher, student, what)
    with pytest.raises(ValueError, match="^role 'prm_teacher': teacher .*Teachers with another tokenizer'\\)$"):
        check_vocab(teacher, student, f"role 'prm_teacher': weights {teacher!r}")


def _sample(student_tok, text_prompt, text_response, masked=None):
    """Student ids of prompt + response (the response optionally with a masked middle segment)."""
    tok = xt.load_tokenizer(student_tok)
    prompt = tok.encode(text_prompt, add_special_tokens=False).ids
    pieces = [text_response] if masked is None else [text_response, masked, text_response]
    response, mask = [], []
    for i, piece in enumerate(pieces):
        ids = tok.encode(piece, add_special_tokens=False).ids
        response += ids
        mask += [0 if i == 1 else 1] * len(ids)
    return torch.tensor(prompt + response), len(response), torch.tensor(mask)


def test_teacher_sample_whole_sequence_cut_to_responses(qwen3, deepseek):
    tokens, response, mask = _sample(qwen3, "<|im_start|>user\n" + TEXTS["chinese"] + "<|im_end|>\n",
                                     TEXTS["english"], masked="\n<tool>" + TEXTS["emoji"] + "</tool>\n")
    sample = ct.teacher_sample(tokens, response, mask, qwen3, deepseek)
    s_tok, t_tok = xt.load_tokenizer(qwen3), xt.load_tokenizer(deepseek)
    t_ids = sample.tokens.tolist()
    prompt_t = t_ids[:len(t_ids) - sample.response_length]
    response_t = t_ids[len(t_ids) - sample.response_length:]
    s_resp = tokens[len(tokens) - response:].tolist()
    assert b"".join(xt.token_bytes(t_tok, response_t)) == b"".join(xt.token_bytes(s_tok, s_resp))
    # DeepSeek has no <|im_start|> / <|im_end|>: those prompt tokens are left out (mapped by content, none)
    spelled = b"".join(xt.token_bytes(s_tok, tokens[:-response].tolist()))
    assert b"".join(xt.token_bytes(t_tok, prompt_t)) == spelled.replace(b"<|im_start|>", b"").replace(
        b"<|im_end|>", b"")
    assert sample.alignment.unmapped_special == 2
    a = sample.alignment
    assert a.student_chunk.numel() == response and a.teacher_chunk.numel() == sample.response_length
    assert int(a.student_chunk.min()) == 0 and int(a.teacher_chunk.max()) == a.n_chunks - 1
    s_bytes, t_bytes = xt.token_bytes(s_tok, s_resp), xt.token_bytes(t_tok, response_t)
    for j in range(a.n_chunks):  # each chunk the same bytes on both sides
        assert b"".join(p for p, c in zip(s_bytes, a.student_chunk.tolist()) if c == j) == \
            b"".join(p for p, c in zip(t_bytes, a.teacher_chunk.tolist()) if c == j)
    # the loss-mask changes are chunk starts: no chunk holds masked and unmasked tokens
    for j in range(a.n_chunks):
        assert len({int(m) for m, c in zip(mask.tolist(), a.student_chunk.tolist()) if c == j}) == 1
    assert ct.loss_mask_boundaries(3, [1, 1, 0, 0, 1]) == [3, 5, 7]


def test_micro_batches_under_the_student_budget():
    budget = ct.student_budget([10, 12, 7, 9], [[0, 1], [2, 3]])
    assert budget == 22
    assert ct.split_micro_batches([11, 11, 5, 30, 4], budget) == [[0, 1], [2], [3], [4]]
    with pytest.raises(ValueError, match="budget"):
        ct.split_micro_batches([1], 0)
    # at least as many as the student's (an interleaved pipeline asks a minimum): the largest split
    assert ct.split_micro_batches([3, 3, 3, 3], 100, at_least=2) == [[0, 1], [2, 3]]
    assert ct.split_micro_batches([3, 3, 9], 100, at_least=3) == [[0], [1], [2]]
    assert ct.split_micro_batches([5], 100, at_least=2) == [[0]]  # one sample cannot be split
    assert ct.pass_batches([6, 6], 12) == ct.PassBatches([[0, 1]], [])
    # more micro-batches than the samples split into (agreed with other expert-parallel ranks): the
    # shortest sample repeated alone; its values dropped, the repeat given its source's inputs
    plan = ct.pass_batches([6, 4], 100, at_least=4)
    assert plan == ct.PassBatches([[0], [1], [2], [3]], [1, 1])
    assert plan.padded(["a", "b"]) == ["a", "b", "b", "b"] and plan.unpadded([0, 1, 2, 3]) == [0, 1]
    assert ct.pass_batches([], 100, at_least=2) == ct.PassBatches([], [])


def test_slimes_rollout_of_the_teachers_passes():
    """integrations/megatron/opd/cross_rollout.py: the plan in slime's keys (the core returns plain indices)."""
    from megatron_rl_patches.integrations.megatron.opd.cross_rollout import teacher_rollout

    sample = ct.TeacherSample(torch.arange(6), 2, None)
    rollout = teacher_rollout([sample, sample], ct.pass_batches([6, 6], 12))
    assert rollout["micro_batch_indices"] == [[0, 1]] and rollout["num_microbatches"] == [1]
    assert rollout["total_lengths"] == [6, 6] and rollout["response_lengths"] == [2, 2]
    assert rollout["loss_masks"][0].tolist() == [1, 1]
    short = ct.TeacherSample(torch.arange(4), 1, None)
    rollout = teacher_rollout([sample, short], ct.pass_batches([6, 4], 100, at_least=4))
    assert rollout["micro_batch_indices"] == [[0], [1], [2], [3]] and rollout["num_microbatches"] == [4]
    assert rollout["total_lengths"] == [6, 4, 4, 4] and rollout["tokens"][3] is short.tokens


def _model(vocab, rows, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, H, generator=g, dtype=torch.float64) * 2,
            torch.randn(vocab, H, generator=g, dtype=torch.float64))


@pytest.fixture(scope="module")
def pair(qwen3, deepseek):
    tokens, response, mask = _sample(qwen3, "Q: ", TEXTS["mixed"] + TEXTS["code"])
    sample = ct.teacher_sample(tokens, response, mask, qwen3, deepseek)
    shared = xt.shared_strings(qwen3, deepseek)
    s_tok, t_tok = xt.load_tokenizer(qwen3), xt.load_tokenizer(deepseek)
    h, w = _model(s_tok.get_vocab_size(), response, 0)
    th, tw = _model(t_tok.get_vocab_size(), sample.response_length, 1)
    return tokens[-response:], sample, shared, (h, w), (th, tw)


def _brought_back(sample, shared, student, teacher, alignment=None):
    """Per student token, the chunk-start divergence through the slime pieces: the teacher's top-k
    and bucket ids on its rows, its grouped values on the student's rows, the student's buckets."""
    alignment = alignment or sample.alignment
    (h, w), (th, tw) = student, teacher
    top = lm_head_topk_ids(th, tw, K)
    buckets = ct.chunk_start_buckets(top, alignment, shared)
    t_lp, t_tail = lm_head_topk_logprobs(th, tw, buckets.teacher_ids, ids_mask=buckets.teacher_mask)
    values, tails = ct.teacher_buckets_on_student_rows(t_lp, t_tail, buckets, alignment)
    s_lp, s_tail = lm_head_topk_logprobs(h, w, buckets.student_ids, ids_mask=buckets.student_mask)
    from megatron_rl_patches.cross_tokenizer.losses import bucket_log_probs

    s_b = bucket_log_probs(s_lp, buckets.student_mask, buckets.alive)
    return topk_kl(s_b, s_tail, values, tails, divergence="forward_kl", ids_mask=buckets.alive), buckets


def test_chunk_start_buckets_brought_back_equal_part_one(pair):
    ids, sample, shared, student, teacher = pair
    value, buckets = _brought_back(sample, shared, student, teacher)
    expected = xt.chunk_start_topk_divergence(student[0], student[1], teacher[0], teacher[1], sample.alignment,
                                              shared, k=K, divergence="forward_kl")
    torch.testing.assert_close(value, expected.to(value), rtol=1e-9, atol=1e-12)
    starts, _ = sample.alignment.chunk_starts()
    assert buckets.alive[starts].any() and not buckets.alive[
        torch.ones(len(ids), dtype=torch.bool).index_fill(0, starts, False)].any()
    assert value[starts].abs().sum() > 0
    # negative control: the alignment shifted by one chunk moves every bucket and changes the value
    a = sample.alignment
    shifted = type(a)(a.student_chunk, (a.teacher_chunk + 1) % a.n_chunks, a.n_chunks)
    moved, _ = _brought_back(sample, shared, student, teacher, shifted)
    assert (moved - value).abs().max() > 1e-3


def test_ids_past_the_teachers_tokenizer_spell_nothing(pair):
    """A teacher model's vocabulary padded past its tokenizer (Megatron's padding, a config's spare
    rows): such a top-k id is no string, as an unshared id (it indexed past the string table)."""
    ids, sample, shared, student, (th, tw) = pair
    top = lm_head_topk_ids(th, tw, K)
    unshared = int(torch.nonzero(shared.teacher_string < 0)[0])
    past, plain = top.clone(), top.clone()
    past[:, 0], plain[:, 0] = shared.teacher_string.numel() + 7, unshared
    got, want = (ct.chunk_start_buckets(t, sample.alignment, shared) for t in (past, plain))
    for field in ("teacher_ids", "teacher_mask", "student_ids", "student_mask", "alive"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert not torch.equal(ct.chunk_start_buckets(top, sample.alignment, shared).alive, got.alive)


def test_log_ratio_is_part_one_token_term(pair):
    ids, sample, shared, (h, w), (th, tw) = pair
    s_lp, _ = lm_head_log_probs_and_entropy(h, w, ids)
    t_ids = sample.tokens[-sample.response_length:]
    t_lp, _ = lm_head_log_probs_and_entropy(th, tw, t_ids)
    ratio = ct.log_ratio(s_lp, t_lp, sample.alignment)
    torch.testing.assert_close(-ratio, xt.chunk_reverse_kl(s_lp, t_lp, sample.alignment).detach())
    a = sample.alignment
    per_chunk = torch.zeros(a.n_chunks, dtype=torch.float64).index_add(0, a.teacher_chunk, t_lp)
    torch.testing.assert_close((ratio + s_lp).sum(), per_chunk.sum())  # chunk sums exact


@pytest.mark.parametrize(("values", "named"), [
    ({"use_opd": True, "opd_type": "megatron"}, "--opd-type sglang"),
    ({"use_opd": True, "opd_type": "sglang", "two": True}, "one teacher with ';tokenizer=own' \\(got 2\\)"),
])
def test_slime_opd_modes_refused_before_loading(values, named):
    from types import SimpleNamespace

    from megatron_rl_patches.integrations.slime.cross_loss import check_args

    own = opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": "/ckpt/t;tokenizer=own"})
    same = opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": "/ckpt/t"})
    args = SimpleNamespace(virtual_pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                           allgather_cp=True, use_opd=False)
    check_args(args, own)  # served: every layout (VPP, EP and --allgather-cp too)
    if values.pop("two", False):
        own = opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": "/ckpt/s,/ckpt/t;tokenizer=own,/ckpt/u;tokenizer=own",
                            "MEGATRON_RL_PATCHES_OPD_WEIGHTS": "0.2,0.4,0.4"})
    for name, value in values.items():
        setattr(args, name, value)
    check_args(args, same)  # a teacher of the student's tokenizer: nothing of this applies
    with pytest.raises(ValueError, match=named.replace("-", r"\-")):
        check_args(args, own)
    if args.use_opd and args.opd_type == "sglang":  # one teacher of another tokenizer beside others: served
        check_args(args, opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": "/ckpt/s,/ckpt/t;tokenizer=own"}))


def test_the_old_module_path_is_the_moved_module():
    """integrations/slime/cross_teachers.py moved to cross_tokenizer/teacher_passes.py (issue 56): the
    old path imports the new module itself, with one DeprecationWarning naming the new path."""
    import importlib
    import sys

    old = "megatron_rl_patches.integrations.slime.cross_teachers"
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to megatron_rl_patches.cross_tokenizer.teacher_passes"):
        module = importlib.import_module(old)
    assert module is ct and module.teacher_sample is xt.teacher_sample
