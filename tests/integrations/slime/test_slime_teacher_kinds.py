"""slime's OPD reads the teachers' table: each kind of `teachers.kinds` has its builder in
`teacher_builders.BUILDERS` (a kind without one cannot be added unnoticed), a served entry is
checked against slime's args (its rollout temperature) before anything loads, and its builder
refuses by name until slime's OPD takes the ids from the teacher."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_rl_patches.integrations.slime import opd as slime_opd
from megatron_rl_patches.integrations.slime import teacher_builders
from megatron_rl_patches.integrations.slime.opd_settings import LOSS_PATH, opd_settings
from megatron_rl_patches.teachers import kinds

TEACHERS = "MEGATRON_RL_PATCHES_OPD_TEACHERS"


def _args(**values):
    base = dict(loss_type="custom_loss", custom_loss_function_path=LOSS_PATH, context_parallel_size=1)
    return SimpleNamespace(**{**base, **values})


def test_every_kind_of_the_table_has_a_slime_builder():
    assert set(teacher_builders.BUILDERS) == set(kinds.REGISTRY)


def test_a_served_entry_refuses_a_rollout_temperature_other_than_one_by_name():
    settings = opd_settings({TEACHERS: "/ckpt/a,http://127.0.0.1:9;engine=vllm"})
    slime_opd.check_args(_args(rollout_temperature=1.0), settings)
    with pytest.raises(ValueError, match="served teacher, and slime's --rollout-temperature is 0.6"):
        slime_opd.check_args(_args(rollout_temperature=0.6), settings)
    slime_opd.check_args(_args(rollout_temperature=0.6), opd_settings({TEACHERS: "/ckpt/a"}))  # negative control


def test_the_served_builder_refuses_naming_ids_from_teacher():
    actor = SimpleNamespace(args=_args(rollout_temperature=1.0), model=[SimpleNamespace(vocab_size=64)])
    with pytest.raises(ValueError, match="entry 'http://127.0.0.1:9': served teachers in slime's OPD need "
                                         "MEGATRON_RL_PATCHES_OPD_IDS_FROM=teacher"):
        slime_opd.load_teachers(actor, opd_settings({TEACHERS: "http://127.0.0.1:9;engine=vllm"}))
