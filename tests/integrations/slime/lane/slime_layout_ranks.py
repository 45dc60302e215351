"""One 2-rank slime lane world (the student at TP=1 x DP=2) for a teacher at its own layout (issue
58): slime_opd's `train_actor` with a Hugging Face teacher at the student's layout and written
`PATH;tp=2` (and with a privileged context, `PATH;tp=2;context=hint`), then the `prm_teacher` role
from the same directory at `prm_teacher;tp=2` and at the student's layout, each rank with its own
rollout. Spawned ranks import it by name."""
from __future__ import annotations

from typing import Any

ROLLOUTS = 2  # train_actor re-entered: the teacher at its layout scores a second rollout on the same groups
# the student at other layouts over the same 2 ranks, the teacher at tp=2 beside it: (pipeline, context)
STUDENTS = {"pp2": (2, 1), "cp2": (1, 2)}
HINTS = ([5, 9, 33, 2, 17], [40, 1, 8], [12, 60, 7, 7, 3, 21], [2, 50])  # each sample's context (ids < 64)


def _timer_reset() -> None:
    from slime.observability.timer import Timer

    Timer().start_time.pop("train_wait", None)  # one Timer per process: the run before left it started


def layout_world(rank: int, world_size: int, hf: str) -> dict[str, Any]:
    import slime_ranks

    results: dict[str, Any] = {}
    for name, entry in (("student_layout", hf), ("tp2", f"{hf};tp=2")):
        if results:  # slime's stand-ins are installed by now (lane_rank)
            _timer_reset()
        results[name] = slime_ranks.opd_train_actor(rank, world_size, 1, hf_teacher=entry, rollouts=ROLLOUTS)
    for student, (pipeline, context) in STUDENTS.items():  # one rollout each: the teacher's rows at that layout
        for name, entry in (("student_layout", hf), ("tp2", f"{hf};tp=2")):
            _timer_reset()
            results[f"{student}_{name}"] = slime_ranks.opd_train_actor(rank, world_size, pipeline, context,
                                                                        hf_teacher=entry)
    # a privileged context (`;context=hint`): at the student's layout, at tp=2, and at tp=2 with each
    # context rolled by one token (a control; the run without a context is "tp2" above)
    for name, entry, contexts in (("ctx_student_layout", f"{hf};context=hint", HINTS),
                                  ("ctx_tp2", f"{hf};tp=2;context=hint", HINTS),
                                  ("rolled_tp2", f"{hf};tp=2;context=hint", [h[1:] + h[:1] for h in HINTS])):
        _timer_reset()
        results[name] = slime_ranks.opd_train_actor(rank, world_size, 1, hf_teacher=entry,
                                                    contexts=[{"hint": list(h)} for h in contexts])
    for name, entry in (("cp2_ctx_student_layout", f"{hf};context=hint"), ("cp2_ctx_tp2", f"{hf};tp=2;context=hint")):
        _timer_reset()  # the student at CP=2: each rank its zigzag rows of the privileged sequences
        results[name] = slime_ranks.opd_train_actor(rank, world_size, 1, 2, hf_teacher=entry,
                                                    contexts=[{"hint": list(h)} for h in HINTS])
    with slime_ranks.lane_rank(rank, world_size) as patch:
        import slime_kit as kit

        import megatron_rl_patches

        megatron_rl_patches.apply(only=["inference_roles", "slime_fused", "gpt_output_processor"])  # as with =all
        try:
            roles = {}
            for name, entry in (("tp2", "prm_teacher;tp=2"), ("student_layout", "prm_teacher")):
                log_probs, model = kit.prm_role_log_probs(hf, entry, patch, slime_ranks.TEMPERATURE,
                                                          *slime_ranks.ACTOR_SPEC, seed=10 + rank)
                roles[name] = {"log_probs": log_probs, "at_layout": getattr(model, "teacher_groups", None) is not None}
        finally:
            megatron_rl_patches.revert()
    results["role"] = roles
    return results
