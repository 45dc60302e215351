"""What slime's OPD cannot serve with a served teacher of the student's tokenizer without a head
(`check_served`), checked from the settings alone: by `check_settings` (doctor, `run`, the start-up
hook) before the job starts, and again by the actor before anything loads. Standard library only
(the start-up hook reads it)."""
from __future__ import annotations

from megatron_rl_patches.integrations.megatron.opd.opd_settings import TEACHERS, OpdSettings, Teacher
from megatron_rl_patches.settings import OPD_IDS_FROM
from megatron_rl_patches.teachers.entry import SERVED


def top_k_only(teacher: Teacher) -> bool:
    """A served teacher that scores only its own top-k (no `;head=DIR`: the engine's log-probs)."""
    return teacher.kind == SERVED and teacher.head is None


def check_served(settings: OpdSettings) -> None:
    """ValueError naming the entry for what slime's OPD cannot serve with a served teacher of the
    student's tokenizer without a head, the same on every rank: ids from the student or the union,
    one after the first teacher of the student's tokenizer (a served teacher of another tokenizer
    scores its own encoding, one with `;head=DIR` any ids from its hidden states: any place, any
    ids)."""
    same = [index for index, teacher in enumerate(settings.teachers) if not teacher.other_tokenizer]
    served = [index for index in same if top_k_only(settings.teachers[index])]
    if not served:
        return
    first = settings.teachers[served[0]]
    if settings.ids_from != "teacher":
        raise ValueError(f"{TEACHERS} entry '{first.path}' with {OPD_IDS_FROM}={settings.ids_from}: a served engine "
                         f"scores its own top-k only, not given ids; set {OPD_IDS_FROM}=teacher and name the served "
                         "teacher first, or serve its hidden states and add ';head=DIR' (its Hugging Face directory)")
    later = [index for index in served if index != same[0]]
    if later:
        raise ValueError(f"{TEACHERS} entry '{settings.teachers[later[0]].path}': a served teacher after the first "
                         "would score the first teacher's ids, which the engine does not take (it scores its own "
                         f"top-k only); name it first in {TEACHERS}, or serve one teacher")
