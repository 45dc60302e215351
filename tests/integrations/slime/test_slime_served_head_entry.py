"""slime's OPD with a served teacher's head (`http://host:port;engine=vllm;head=DIR`): the entry is
parsed with its head, takes any MEGATRON_RL_PATCHES_OPD_IDS_FROM, any place in the teacher list
and slime's --rollout-temperature, while a served teacher without a head keeps its refusals; what
the head cannot serve is refused by name. (Against a real pooling server and slime's train_actor:
tests/integrations/slime/lane/test_slime_opd_served_head_lane.py.)"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_rl_patches.integrations.megatron.opd.opd_settings import LOSS_PATH, opd_settings
from megatron_rl_patches.integrations.slime import opd as slime_opd
from megatron_rl_patches.teachers.entry import SERVED
from megatron_rl_patches.teachers.kinds import parse_entries

P = "MEGATRON_RL_PATCHES_OPD_"
HEAD = "http://t:1;engine=vllm;head=/dirs/teacher"


def _args(**values):
    base = dict(loss_type="custom_loss", custom_loss_function_path=LOSS_PATH, context_parallel_size=1,
                rollout_temperature=1.0)
    return SimpleNamespace(**{**base, **values})


def test_the_head_option_is_read_into_the_entry_beside_the_others():
    head, plain, local = parse_entries(f"{HEAD},http://t:2;engine=vllm,/ckpt/b")
    assert (head.kind, head.path, head.engine, head.head) == (SERVED, "http://t:1", "vllm", "/dirs/teacher")
    assert (plain.kind, plain.head) == (SERVED, None)
    assert local.head is None and not head.other_tokenizer
    (tokenless,) = parse_entries("http://t:1;engine=vllm;head=/d;same_tokenizer;vocab=64")  # no tokenizer served
    assert (tokenless.head, tokenless.same_tokenizer, tokenless.vocab) == ("/d", True, 64)


def test_what_a_head_entry_cannot_be_is_refused_naming_the_entry():
    with pytest.raises(ValueError, match="unknown option 'heads=/d'.*';head=DIR'"):
        parse_entries("http://t:1;engine=vllm;heads=/d")


def test_a_head_with_another_tokenizer_is_read_as_a_teacher_of_another_tokenizer():
    """`;head=DIR;tokenizer=DIR` (refused before: exact cross-tokenizer buckets through the head)."""
    (entry,) = parse_entries("http://t:1;engine=vllm;head=/d;tokenizer=/tok")
    assert (entry.head, entry.tokenizer, entry.other_tokenizer) == ("/d", "/tok", True)
    settings = opd_settings({P + "TEACHERS": f"/b,{entry.path};engine=vllm;head=/d;tokenizer=/tok",
                             P + "IDS_FROM": "union"})
    slime_opd.check_args(_args(rollout_temperature=0.7), settings)  # a head: any temperature


def test_a_head_with_another_tokenizer_skips_the_students_vocabulary_and_asks_the_server(tmp_path):
    """At load: DIR's vocabulary (1001) is not the student's (64) and is not refused for it; the
    pair is read and the server asked (a generate server here: refused naming the pooling runner)."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("httpx", reason="the served extra (httpx) is missing")
    from megatron_rl_patches.integrations.megatron.opd.served_teacher import build_served_teacher
    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint
    from tests.cross_tokenizer.conftest import sentencepiece_like
    from tests.teachers.local_servers import url_of, vllm_like

    write_tiny_checkpoint(tmp_path / "teacher", tiny_hf_config("qwen3"), seed=1)  # vocabulary 1001
    sentencepiece_like("first").save(str(tmp_path / "teacher" / "tokenizer.json"))
    (tmp_path / "student").mkdir()
    sentencepiece_like("never").save(str(tmp_path / "student" / "tokenizer.json"))
    teacher = tmp_path / "teacher"
    actor = SimpleNamespace(args=_args(hf_checkpoint=str(tmp_path / "student")),
                            model=[SimpleNamespace(vocab_size=64)])
    with vllm_like() as server:
        url = url_of(server)
        settings = opd_settings({P + "TEACHERS": f"{url};engine=vllm;head={teacher};tokenizer={teacher}"})
        assert settings is not None
        with pytest.raises(ValueError, match=f"OPD_TEACHERS entry '{url}'.*--runner pooling") as refused:
            build_served_teacher(actor, settings, 0, settings.teachers[0], 64, "served")
        assert any(path == "/pooling" for path, _ in server.seen)
    assert "1001" not in str(refused.value)  # not the vocabulary check of a teacher of the student's tokenizer


@pytest.mark.parametrize("teachers, ids_from", [
    (f"{HEAD},/b", "student"),
    (f"/b,{HEAD}", "union"),
    (f"/b,{HEAD}", "teacher"),  # after the first: it scores the first one's ids
    (f"{HEAD},{HEAD.replace(':1', ':2')}", "student"),  # two served heads
])
def test_a_head_teacher_takes_any_ids_any_place_and_the_rollout_temperature(teachers, ids_from):
    settings = opd_settings({P + "TEACHERS": teachers, P + "IDS_FROM": ids_from})
    slime_opd.check_args(_args(rollout_temperature=0.7), settings)


@pytest.mark.parametrize("teachers, ids_from, words", [
    # without a head a served teacher keeps every refusal, beside a head teacher too
    (f"{HEAD},http://t:2;engine=vllm", "teacher", "entry 'http://t:2': a served teacher after the first"),
    (f"http://t:2;engine=vllm,{HEAD}", "student", "IDS_FROM=student: a served engine scores its own top-k only.*"
                                                  "';head=DIR'"),
])
def test_a_served_teacher_without_a_head_keeps_its_refusals(teachers, ids_from, words):
    settings = opd_settings({P + "TEACHERS": teachers, P + "IDS_FROM": ids_from})
    with pytest.raises(ValueError, match=words):
        slime_opd.check_args(_args(), settings)


def test_only_a_served_teacher_without_a_head_refuses_another_temperature():
    mixed = opd_settings({P + "TEACHERS": f"http://t:2;engine=vllm,{HEAD}", P + "IDS_FROM": "teacher"})
    with pytest.raises(ValueError, match="entry 'http://t:2' is a served teacher, and slime's --rollout-temperature "
                                         "is 0.7"):
        slime_opd.check_args(_args(rollout_temperature=0.7), mixed)
    slime_opd.check_args(_args(rollout_temperature=1.0), mixed)  # control: a top-k server first, a head after it


def test_a_head_of_another_vocabulary_is_refused_at_load_naming_the_entry(tmp_path):
    from megatron_rl_patches.integrations.megatron.opd.served_teacher import build_served_teacher
    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint

    write_tiny_checkpoint(tmp_path / "teacher", tiny_hf_config("qwen3"), seed=1)  # vocabulary 1001
    settings = opd_settings({P + "TEACHERS": f"http://127.0.0.1:9;engine=vllm;head={tmp_path / 'teacher'}"})
    actor = SimpleNamespace(args=_args(), model=[SimpleNamespace(vocab_size=64)])
    assert settings is not None
    with pytest.raises(ValueError, match=r"MEGATRON_RL_PATCHES_OPD_TEACHERS entry 'http://127.0.0.1:9'.*1001"):
        build_served_teacher(actor, settings, 0, settings.teachers[0], 64, "served")


def test_a_head_of_another_tokenizer_leaves_the_steps_ids_request_to_the_others():
    """A served head of another tokenizer scores its own buckets: it takes no request for the
    step's ids (a union's first request stays for the first teacher of the student's tokenizer),
    as an in-process teacher of another tokenizer; off the last stage (no teacher) it scores None."""
    from megatron_rl_patches.integrations.megatron.opd.opd_teachers import ScoringStep, teacher_requests
    from megatron_rl_patches.integrations.megatron.opd.served_opd import ServedOpdTeacher
    from megatron_rl_patches.integrations.megatron.opd.stage_host import StageHost

    settings = opd_settings({P + "TEACHERS": f"{HEAD};tokenizer=/tok,/b", P + "IDS_FROM": "union"})
    assert settings is not None
    step = ScoringStep(None, {}, settings, last=False, student={}, topk_pass=lambda *_: {})
    assert ServedOpdTeacher(None, StageHost(64, last=False, asks=False), cross=True).score(step) is None
    assert step.scored_ids == 0 and step.ids_request() == teacher_requests(settings)[0]
