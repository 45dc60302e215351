"""slime's OPD reads the teachers' table: each kind of `teachers.kinds` has its builder in
`teacher_builders.BUILDERS` (a kind without one cannot be added unnoticed), a served entry is
checked against slime's args (its rollout temperature) and needs the ids from the teacher, before
anything loads (the builder against a real server: tests/teachers/lane/test_served_opd_vllm.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_rl_patches.integrations.megatron.opd import teacher_builders
from megatron_rl_patches.integrations.megatron.opd.opd_settings import LOSS_PATH, opd_settings
from megatron_rl_patches.integrations.slime import opd as slime_opd
from megatron_rl_patches.teachers import kinds

TEACHERS = "MEGATRON_RL_PATCHES_OPD_TEACHERS"


def _args(**values):
    base = dict(loss_type="custom_loss", custom_loss_function_path=LOSS_PATH, context_parallel_size=1)
    return SimpleNamespace(**{**base, **values})


def test_every_kind_of_the_table_has_a_slime_builder():
    assert set(teacher_builders.BUILDERS) == set(kinds.REGISTRY)


def test_a_served_entry_refuses_a_rollout_temperature_other_than_one_by_name():
    settings = opd_settings({TEACHERS: "http://127.0.0.1:9;engine=vllm,/ckpt/a",
                             "MEGATRON_RL_PATCHES_OPD_IDS_FROM": "teacher"})
    slime_opd.check_args(_args(rollout_temperature=1.0), settings)
    with pytest.raises(ValueError, match="served teacher, and slime's --rollout-temperature is 0.6"):
        slime_opd.check_args(_args(rollout_temperature=0.6), settings)
    slime_opd.check_args(_args(rollout_temperature=0.6), opd_settings({TEACHERS: "/ckpt/a"}))  # negative control


def test_a_served_entry_needs_the_ids_from_the_teacher_before_anything_loads():
    actor = SimpleNamespace(args=_args(rollout_temperature=1.0), model=[SimpleNamespace(vocab_size=64)])
    with pytest.raises(ValueError, match="entry 'http://127.0.0.1:9' with MEGATRON_RL_PATCHES_OPD_IDS_FROM=student: "
                                         "a served engine scores its own top-k only"):
        slime_opd.load_teachers(actor, opd_settings({TEACHERS: "http://127.0.0.1:9;engine=vllm"}))
