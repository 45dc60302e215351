"""A slime served teacher's `;context=KEY` has one owner, its `ServedOpdTeacher`: the client is
built from the entry without it (`TeacherEntry.without_context`), and the teacher step is handed
`Privileged(client, KEY)` for a teacher of the student's tokenizer, the bare client for one of
another tokenizer (whose contexts `begin` puts before its own encodings). Against slime's real
train_actor and vLLM servers: tests/integrations/slime/lane/test_slime_opd_served_context_lane.py."""
from __future__ import annotations

import pytest

pytest.importorskip("httpx")

from megatron_rl_patches.integrations.megatron.opd.served_opd import ServedOpdTeacher  # noqa: E402
from megatron_rl_patches.integrations.megatron.opd.stage_host import StageHost  # noqa: E402
from megatron_rl_patches.ops.scoring_plan import ScoringPlan  # noqa: E402
from megatron_rl_patches.teachers.kinds import parse_entries  # noqa: E402
from megatron_rl_patches.teachers.served.build import served_teacher_of  # noqa: E402
from megatron_rl_patches.teachers.step.served import OwnTopkServed  # noqa: E402

URL = "http://teacher.invalid:1;engine=vllm;context=hint"


def entry():
    (one,) = parse_entries(URL, "MEGATRON_RL_PATCHES_OPD_TEACHERS")
    return one


def test_the_entry_without_its_key_is_the_same_entry_keyless():
    whole = entry()
    bare = whole.without_context()
    assert whole.context == "hint" and bare.context is None
    assert {**vars(bare), "context": "hint"} == vars(whole)


def test_the_step_reads_the_key_from_the_opd_teacher_and_the_client_holds_none():
    client = served_teacher_of(entry().without_context(), ScoringPlan(2))
    try:
        keyed = ServedOpdTeacher(OwnTopkServed(client, 64), StageHost(64), context="hint")
        assert client.context is None
        assert keyed.step.teachers == [client] and keyed.step.keys == ["hint"]
        plain = ServedOpdTeacher(OwnTopkServed(client, 64), StageHost(64))
        assert plain.step.keys == [None]
        crossed = ServedOpdTeacher(OwnTopkServed(client, 64), StageHost(64), cross=True, context="hint")
        assert crossed.step.keys == [None] and crossed.context == "hint"  # its own encodings carry the context
    finally:
        client.close()
