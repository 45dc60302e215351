"""A real vLLM server started with `--skip-tokenizer-init` (as slime starts its own engines): its
`/tokenize` refuses, so the tokenizer check names the flag and the way out; the entry's
`;same_tokenizer;vocab=N` is taken instead (no id sent to find out), and the server scores a
sample of the student's ids as the lane's server with a tokenizer does."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from tests.teachers.lane.served_kit import VOCAB


def test_the_probe_names_the_flag_and_the_entry_option_is_taken(tokenizerless, monkeypatch):
    from megatron_rl_patches.cross_tokenizer.loading import load_tokenizer
    from megatron_rl_patches.integrations.megatron.opd.served_teacher import served_own
    from megatron_rl_patches.integrations.megatron.opd.stage_host import stage_host
    from megatron_rl_patches.teachers import ScoringPlan, ServedTeacher, TeacherBatch
    from megatron_rl_patches.teachers.kinds import parse_entry
    from megatron_rl_patches.teachers.served.tokenizer_probe import probe_tokenizer

    monkeypatch.delenv("MEGATRON_RL_PATCHES_TEACHER_API_KEY", raising=False)
    url, directory = tokenizerless
    with ServedTeacher(url, top_k=4) as teacher:
        with pytest.raises(ValueError, match=r"--skip-tokenizer-init.*';same_tokenizer'"):
            probe_tokenizer(teacher, load_tokenizer(str(directory), "student"), "the entry")
    args = SimpleNamespace(hf_checkpoint=str(directory))
    settings = cast(Any, SimpleNamespace(plan=lambda: ScoringPlan(4)))  # the OPD settings' plan: K = 4
    with pytest.raises(ValueError, match=rf"past the served model's vocabulary of {VOCAB - 1}"):
        served_own(args, settings, parse_entry(f"{url};engine=vllm"), stage_host(VOCAB), "the entry", VOCAB - 1)
    teacher = served_own(args, settings, parse_entry(f"{url};engine=vllm"), stage_host(VOCAB), "the entry",
                         VOCAB).teacher
    try:
        scores = teacher.score(TeacherBatch([torch.tensor([1, 5, 9, 13, 17])], [2]))
    finally:
        teacher.close()
    assert scores.topk_ids[0].shape == (3, 4) and bool((scores.topk_log_probs[0] <= 0).all())
