"""slime's OPD builder for a served teacher (`http://host:port;engine=vllm`, the `served` row of
`teachers.kinds`): `served_opd.ServedOpdTeacher` over a `ServedTeacher`, and the settings it needs,
checked before anything loads (`check_served`): a served engine scores its own top-k only, so the
buckets come from it (MEGATRON_RL_PATCHES_OPD_IDS_FROM=teacher, the served teacher first); one with
another tokenizer (`;tokenizer=DIR`) is `served_cross_opd.ServedCrossOpdTeacher`; one with a head
(`;head=DIR`: hidden states) is `served_head_opd.ServedHeadOpdTeacher`, which scores any ids."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches._variables import OPD_IDS_FROM
from megatron_rl_patches.integrations.slime.opd_settings import TEACHERS, OpdSettings, Teacher
from megatron_rl_patches.integrations.slime.opd_teachers import OpdTeacher
from megatron_rl_patches.integrations.slime.served_cross_opd import build_served_cross
from megatron_rl_patches.integrations.slime.served_head_opd import build_served_head
from megatron_rl_patches.integrations.slime.served_opd import build_served
from megatron_rl_patches.teachers.kinds.entry import SERVED
from megatron_rl_patches.teachers.named_vocab import named_vocab_size


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


def build_served_teacher(actor: Any, settings: OpdSettings, index: int, teacher: Teacher, student: int | str,
                         route: str) -> OpdTeacher:
    """The served teacher of `teacher` for slime's actor: the server asked (it answers, K within
    its --max-logprobs, its tokenizer: the student's, or the one `;tokenizer=DIR` names) by the
    ranks that will ask it, agreed by all."""
    check_served(settings)
    where = f"{TEACHERS} entry '{teacher.path}'"
    if teacher.head is not None:  # with ';tokenizer=DIR' too: exact buckets through the head
        return build_served_head(actor, settings, teacher, student, where)
    if teacher.tokenizer is not None:
        return build_served_cross(actor.args, settings, teacher, where)
    head = actor.model[-1]
    while hasattr(head, "module"):  # the wrapped chunk (DDP, Float16Module) holds the vocabulary
        head = head.module
    vocab = int(head.vocab_size)
    named = named_vocab_size(teacher, where) if teacher.same_tokenizer else None
    return build_served(actor.args, settings, teacher.path, str(teacher.engine), vocab, where, named)
