"""No bare library error from the teachers' public constructors and calls: an int too large for a
float (OverflowError in math.isfinite), seconds past what a wait can take (OverflowError in
threading), a dtype checked by dictionary lookup (a list: "unhashable type") or given where nothing
reads it, an id past int64 (torch's "Overflow when unpacking long long"), text holding a lone
surrogate (the tokenizers library's TypeError, httpx's UnicodeEncodeError), a text context named by
its place among the texts rather than its sample. Each is a ValueError / TypeError naming the
argument (and the sample) and what to do."""
from __future__ import annotations

import json
import threading

import pytest
import torch

from megatron_rl_patches.integrations.context_fields import field_contexts
from megatron_rl_patches.teachers import (
    ClientSettings,
    ReplicaSettings,
    ServedTeacher,
    TeacherBatch,
    TeacherHead,
    TeacherStep,
    context_ids,
    local_host,
    placed_before,
)
from megatron_rl_patches.teachers.finite import shown
from tests.teachers.local_servers import url_of, vllm_like
from tests.teachers.test_step_contexts import PrefixTeacher, student
from tests.teachers.test_with_context import hinted_tokenizer

HUGE = 10**400  # no float holds it
PAST = 2**64  # past int64


def head(vocab: int = 50) -> TeacherHead:
    return TeacherHead(torch.zeros(vocab, 8), vocab, vocab, 0)


@pytest.mark.parametrize(("build", "words"), [
    (lambda: ReplicaSettings(hedge_floor_s=HUGE), r"ReplicaSettings\(hedge_floor_s=an int of about 401 digits\)"),
    (lambda: ReplicaSettings(hedge_floor_s=-HUGE), r"ReplicaSettings\(hedge_floor_s=an int of about 401 digits\)"),
    (lambda: ReplicaSettings(hedge_floor_s=1e300), r"hedge_floor_s=1e\+300\) must be .* at most"),
    (lambda: ReplicaSettings(hedge_after=HUGE), r"ReplicaSettings\(hedge_after=an int of about 401 digits\)"),
    (lambda: ReplicaSettings(hedge_after=-HUGE), r"ReplicaSettings\(hedge_after=an int of about 401 digits\)"),
    (lambda: ClientSettings(deadline_s=HUGE), r"ClientSettings\(deadline_s=...\) must be a finite number of seconds"),
    (lambda: ClientSettings(timeout_s=-HUGE), r"ClientSettings\(timeout_s=...\) must be a finite number of seconds"),
    (lambda: ClientSettings(backoff_s=HUGE), r"ClientSettings\(backoff_s=...\) must be a finite number of seconds"),
    (lambda: ClientSettings(deadline_s=1e300), r"ClientSettings\(deadline_s=...\) .* at most"),
    (lambda: ClientSettings(connect_timeout_s=threading.TIMEOUT_MAX * 2), r"connect_timeout_s=...\) .* at most"),
    (lambda: ClientSettings(deadline_s=10**5000), r"deadline_s=...\) .* got an int of about 5001 digits"),
    (lambda: ClientSettings(api_key_env="KEY\ud800"), r"ClientSettings\(api_key_env=...\) .* lone surrogate"),
    (lambda: ClientSettings(api_key_env="A=B"), r"ClientSettings\(api_key_env=...\) .* '='"),
    (lambda: ClientSettings(api_key_env="A\0B"), r"ClientSettings\(api_key_env=...\) .* NUL"),
    (lambda: ServedTeacher("http://h\ud800st:8000"), r"the teacher's url holds a lone surrogate .* at character 8"),
    (lambda: ServedTeacher("http://h:8", head=head(), temperature=HUGE), r"ServedTeacher\(temperature=...\) must be a "
                                                                         r"finite number > 0 \(its reciprocal "
                                                                         r"finite\), got an int of about 401"),
    (lambda: ServedTeacher("http://h:8", head=head(), hidden_dtype=[torch.float32]),
     r"ServedTeacher\(hidden_dtype=...\) must be a torch.dtype, one of .*, a list"),
    (lambda: ServedTeacher("http://h:8", head=head(), hidden_dtype="float32"),
     r"ServedTeacher\(hidden_dtype=...\) must be a torch.dtype, one of .*, a str"),
    (lambda: ServedTeacher("http://h:8", hidden_dtype=torch.float16),
     r"ServedTeacher\(hidden_dtype=torch.float16\) is the dtype a head's hidden states travel in.*head="),
    (lambda: ServedTeacher("http://h:8", hidden_dtype=[1]), r"ServedTeacher\(hidden_dtype=\[1\]\) is the dtype"),
    (lambda: TeacherHead(torch.zeros(4, 8), 4, 4, 0, logit_scale=HUGE),
     r"TeacherHead\(logit_scale=an int of about 401 digits\) must be a finite non-zero number"),
    (lambda: TeacherHead(torch.zeros(4, 8), PAST, PAST, 0), r"TeacherHead\(vocab_size=18446744073709551616\) .* int64"),
    (lambda: TeacherHead(torch.zeros(4, 8), 4, 4, HUGE), r"TeacherHead\(first_id=an int of about 401 digits\)"),
    (lambda: TeacherHead(torch.zeros(4, 8), 5, 4, 0), r"TeacherHead\(vocab_size=5\) .* padded_vocab_size=4"),
    (lambda: TeacherHead(torch.zeros(4, 8), 4, 4, 1), r"rows 1..5 .* padded_vocab_size=4"),
    (lambda: TeacherHead([[0.0]], 1, 1, 0), r"TeacherHead\(weight=...\) must be a 2-D floating tensor.*got list"),
    (lambda: TeacherHead(torch.zeros(4, 8, dtype=torch.long), 4, 4, 0), r"TeacherHead\(weight=...\) must be a 2-D "
                                                                        r"floating"),
])
def test_a_bad_number_or_name_is_named(build, words):
    with pytest.raises((ValueError, TypeError), match=words):
        build()


def test_a_logit_scale_no_float_holds_is_named(tmp_path):
    """config.json's `logit_scale` an int of 400 digits (JSON reads it as a Python int)."""
    from megatron_rl_patches.teachers.head.transforms import head_logit_scale

    fields = json.loads('{"architectures": ["LlamaForCausalLM"], "logit_scale": 1' + "0" * 400 + "}")
    with pytest.raises(ValueError, match=r"sets logit_scale=an int of about 401 digits; a logits multiplier must be"):
        head_logit_scale(fields, fields, {}, "/ckpt/t")


def test_seconds_a_wait_takes_are_served():
    """The bound is what a wait can take (threading.TIMEOUT_MAX), and the step runs at it."""
    top = ClientSettings(deadline_s=threading.TIMEOUT_MAX, timeout_s=threading.TIMEOUT_MAX)
    with vllm_like() as server, ServedTeacher(url_of(server), top_k=2, client=top) as teacher:
        assert len(teacher.score(TeacherBatch([torch.tensor([1, 2, 3])], [1])).token_log_probs[0]) == 2


@pytest.mark.parametrize(("contexts", "words"), [
    ({"hint": [[1], [PAST]]}, "sample 1's context under 'hint' holds id 18446744073709551616, past int64"),
    ({"hint": [[1], [3, -PAST]]}, "sample 1's context under 'hint' holds a negative id (-18446744073709551616)"),
    ([{"hint": [1]}, {"hint": [2, HUGE]}], "sample 1's context under 'hint' holds id an int of about 401 digits"),
])
def test_a_context_id_past_int64_is_named(contexts, words):
    step = TeacherStep([PrefixTeacher("hint")], local_host(vocab_size=12))
    with pytest.raises(ValueError) as error:
        step.send(student(), contexts=contexts)
    assert words in str(error.value), error.value


def test_a_marker_past_int64_is_named():
    batch = TeacherBatch([torch.tensor([1, 2, 3])], [2])
    with pytest.raises(ValueError, match=r"placed_before\(marker=...\) holds id 18446744073709551616, past int64"):
        placed_before(batch, [torch.tensor([4])], [1, PAST])


def test_a_lone_surrogate_is_named_by_its_sample():
    with pytest.raises(ValueError, match=r"context_ids\(texts=...\): texts\[1\] holds a lone surrogate \('\\ud800'\) "
                                         r"at character 3"):
        context_ids(["solve", "the\ud800 answer"], hinted_tokenizer())
    with vllm_like() as server, ServedTeacher(url_of(server), top_k=2) as teacher:
        with pytest.raises(ValueError, match=r"ServedTeacher.tokenize\(text=...\) holds a lone surrogate"):
            teacher.tokenize("t1\udc80")
        assert not server.answered("/tokenize")


@pytest.mark.parametrize("flag", ["yes", None, 1])
def test_add_special_tokens_other_than_a_bool_is_named(flag):
    """The tokenizers library's "'str' object is not an instance of 'bool'" otherwise."""
    with pytest.raises(TypeError, match=r"context_ids\(add_special_tokens=...\) must be a bool"):
        context_ids(["solve"], hinted_tokenizer(), add_special_tokens=flag)


@pytest.mark.parametrize("key", ["hint", "sol"])  # two privileged teachers' keys: the message says whose data
@pytest.mark.parametrize(("values", "words"), [
    ([[1, 2], "the\ud800"], "sample 1's text holds a lone surrogate"),
    ([[1, 2], [3], ""], "sample 2's text is empty"),
    ([torch.tensor([1]), "solve", "   "], "sample 2's text tokenizes to no ids"),
])
def test_a_text_context_after_id_contexts_names_its_sample_and_key(values, words, key):
    with pytest.raises(ValueError) as error:
        field_contexts(values, key, "verl", tokenizer=hinted_tokenizer())
    assert words in str(error.value) and str(error.value).startswith(f"verl: context under {key!r}: "), error.value


def test_a_huge_int_is_shown_by_its_size():
    assert shown(HUGE) == "an int of about 401 digits" and shown(-(10**5000)) == "an int of about 5001 digits"
    assert shown(2**64) == "18446744073709551616" and shown(1.5) == "1.5" and shown("x") == "'x'"
