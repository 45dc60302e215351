"""Issue 96 item 6: slime's rollout manager asked to score at the rollout
(MEGATRON_RL_PATCHES_OPD_SCORE_AT=rollout) that finds no teachers in its environment (the settings
given to the training actors only, `--train-env-vars`) says so in one warning line naming where
they go, instead of leaving every sample to the train step without a word; with the teachers
there, or asked at the train step, it says nothing."""
from __future__ import annotations

import logging
import types

from megatron_rl_patches.integrations.slime import rollout_scores

TEACHERS = "MEGATRON_RL_PATCHES_OPD_TEACHERS"
SCORE_AT = "MEGATRON_RL_PATCHES_OPD_SCORE_AT"


def slime_args() -> types.SimpleNamespace:
    return types.SimpleNamespace(rollout_sample_hook_path=None, hf_checkpoint=None)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_score_at_rollout_without_teachers_in_the_rollout_manager_warns_one_line(clean_patch_state, caplog):
    clean_patch_state.setenv(SCORE_AT, "rollout")
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        for _ in range(3):  # every sample's hook asks; the answer is read once per rollout manager
            assert rollout_scores.rollout_teachers(slime_args()) is None
    (line,) = warnings(caplog)
    assert f"{SCORE_AT}=rollout is set in slime's rollout manager, but {TEACHERS} is not" in line, line
    assert "the train step asks every served teacher" in line and "job's runtime_env" in line, line


def test_nothing_is_said_where_the_train_step_asks_or_the_teachers_are_there(clean_patch_state, caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        for place in ("train", ""):  # asked by the train step: nothing to warn about
            clean_patch_state.setenv(SCORE_AT, place)
            assert rollout_scores.rollout_teachers(slime_args()) is None
        clean_patch_state.setenv(SCORE_AT, "rollout")
        clean_patch_state.setenv(TEACHERS, "/ckpt/teacher")  # no served teacher: nothing asked at the rollout
        assert rollout_scores.rollout_teachers(slime_args()) is None
    assert warnings(caplog) == []
