"""slime's OPD builder for a served teacher (`http://host:port;engine=vllm`, the `served` row of
`teachers.kinds`): not built yet — its scores are the teacher's own top-k, so the buckets must come
from the teacher (MEGATRON_RL_PATCHES_OPD_IDS_FROM=teacher), which slime's OPD does not serve yet."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches._variables import OPD_IDS_FROM
from megatron_rl_patches.integrations.slime.opd_settings import TEACHERS, OpdSettings, Teacher
from megatron_rl_patches.integrations.slime.opd_teachers import OpdTeacher


def build_served_teacher(actor: Any, settings: OpdSettings, index: int, teacher: Teacher, student: int | str,
                         route: str) -> OpdTeacher:
    """The served teacher of `teacher` for slime's actor (refused until IDS_FROM=teacher exists)."""
    raise ValueError(f"{TEACHERS} entry '{teacher.path}': served teachers in slime's OPD need "
                     f"{OPD_IDS_FROM}=teacher (a served engine scores its own top-k only), not built yet; use the "
                     "public API (megatron_rl_patches.teachers.ServedTeacher) or an in-process teacher")
