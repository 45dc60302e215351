"""`doctor`'s check of verl's served teacher (MEGATRON_RL_PATCHES_VERL_TEACHER): its entry read by
verl's own parser (`integrations.verl.served.parse_entry`) and its server asked as a slime entry's
is (`served_entry.report`: each replica on its own, then all of them as one teacher, within
doctor's bounds, loading nothing). The live self-teacher's entry (`student;context=KEY`) is read
too; it names no server. verl's K (its distillation config's topk) is not known here: the
servers are asked at k=1, and verl's K is checked against `--max-logprobs` when verl first asks."""
from __future__ import annotations

import os

from megatron_rl_patches.settings import OPD_TEACHERS, VERL_TEACHER
from megatron_rl_patches.teachers.entry import SERVED
from megatron_rl_patches.teachers.kinds import RunFacts

CHECK_K = 1  # any top-k server answers k=1; verl's own K is its config's
ASKED = f", k={CHECK_K})"
SAID = "; verl's K checked when verl first asks)"


def verl_teacher_report() -> tuple[list[str], list[str]]:
    """(problems, what was checked and held) for MEGATRON_RL_PATCHES_VERL_TEACHER; nothing when unset."""
    raw = os.environ.get(VERL_TEACHER, "").strip()
    if not raw:
        return [], []
    from megatron_rl_patches.integrations.verl.entry import parse_entry  # lazy: import cost (the kinds table)

    try:
        entry = parse_entry(raw)
    except ValueError as exc:
        return [str(exc)], []
    if entry.kind != SERVED:  # the live self-teacher: scored on verl's trainer by the student's own model
        return [], []
    from megatron_rl_patches.teachers.kinds.served_entry import report  # lazy: import cost

    found, checked = report(entry, RunFacts(k=CHECK_K))
    return [verl_words(line) for line in found], [verl_words(line) for line in checked]


def verl_words(line: str) -> str:
    """A line of the served entry's report as verl's variable says it: its name first, not slime's,
    and the K it was asked at explained."""
    return f"{VERL_TEACHER}: " + line.removeprefix(f"{OPD_TEACHERS}: ").replace(ASKED, SAID)
