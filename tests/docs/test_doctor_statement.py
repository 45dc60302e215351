"""What `doctor` asks of served teachers is one behaviour (apps/cli/doctor.py and doctor_verl.py:
slime's entries and verl's, each replica), said in one sentence word for word on the two pages that
describe it: docs/distillation.md's replicas and docs/patching.md's `doctor` (the first said each
replica, the second only slime's variable, while verl's servers were never asked)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from doc_blocks import REPO  # noqa: E402

SENTENCE = ("`megatron-rl-patches doctor` asks every served teacher it can see — each served entry of "
            "`MEGATRON_RL_PATCHES_OPD_TEACHERS` and the one of `MEGATRON_RL_PATCHES_VERL_TEACHER` — each replica on "
            "its own, then all of them as one teacher, within 15 s and loading nothing.")


@pytest.mark.parametrize("page", ["docs/distillation.md", "docs/patching.md"])
def test_each_page_says_what_doctor_asks_in_the_same_sentence(page):
    text = " ".join((REPO / page).read_text(encoding="utf-8").split())
    assert SENTENCE in text, page


def test_the_sentence_names_what_doctor_reads():
    from megatron_rl_patches.apps.cli import doctor, doctor_verl
    from megatron_rl_patches.settings import OPD_TEACHERS, VERL_TEACHER
    from megatron_rl_patches.teachers.kinds.served_entry import DOCTOR_DEADLINE_S

    assert f"`{OPD_TEACHERS}`" in SENTENCE and f"`{VERL_TEACHER}`" in SENTENCE
    assert f"within {DOCTOR_DEADLINE_S:g} s" in SENTENCE
    assert doctor.verl_teacher_report is doctor_verl.verl_teacher_report  # verl's variable is asked by doctor
