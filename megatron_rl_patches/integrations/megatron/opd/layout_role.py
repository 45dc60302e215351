"""A role of MEGATRON_RL_PATCHES_INFERENCE_ROLES at its own tensor-parallel layout (`role;tp=N`):
its weights a Hugging Face directory of another architecture than the actor's, built at
TeacherLayout(tp=N) over all ranks on its own process groups (`build_role_at_layout`), at the
entry's residency (`role:swap;tp=N` / `role:stream;tp=N` keep each rank's own shard in host
memory). slime's log-prob passes of that role are served by `layout_role_pass` through score_at_layout.

What it cannot serve is refused by name on every rank before anything loads (`check_role_layout`):
a world the size does not divide, a Megatron checkpoint or a Hugging Face directory of the actor's
architecture (slime's own loading: the actor's provider and loader, in the student's groups), a
student with pipeline or context parallelism, a megatron-core without ProcessGroupCollection."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches._log import logger
from megatron_rl_patches.inference.teacher_layout.layout import TeacherLayout, check_world
from megatron_rl_patches.patching import env


def where(role: str, tp: int) -> str:
    """How errors name the role's entry."""
    return f"{env.INFERENCE_ROLES} role '{role};tp={tp}'"


def check_role_layout(run_args: Any, role: str, tp: int, path: str, step: int | None) -> None:
    """ValueError naming the role's entry for what a role at its own layout does not serve (the
    same on every rank: the loading is agreed by a collective, the rest is the same everywhere)."""
    # lazy: import cost: layout_role_pass imports `where` from here, and the patch records import it without torch
    import torch

    # lazy: import cost: both import torch and megatron-core (as torch above)
    from megatron_rl_patches.integrations.megatron.opd import hf_teachers, layout_teacher

    entry = where(role, tp)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    check_world(tp, world, entry)
    snapshot = (f"{entry}: its weights {path!r} go slime's own route (a Megatron checkpoint, or a Hugging Face "
                "directory of the actor's architecture: the actor's provider and slime's loader, in the student's "
                "process groups); ';tp=' serves a role from a Hugging Face directory of another architecture: "
                "drop ';tp='")
    if step is not None:
        raise ValueError(f"{snapshot} (args.{role}_ckpt_step names a Megatron checkpoint's iteration)")
    loading, _ = hf_teachers.teacher_loading(path, run_args, f"role {role!r}: weights {path!r}")
    if loading != hf_teachers.HF:
        raise ValueError(snapshot)
    for kind, size in layout_teacher.student_sizes().items():
        if size > 1:
            raise ValueError(f"{entry}: the student runs with {kind} parallelism ({kind} size {size}); a role at "
                             "its own layout is served beside a student without it yet: drop ';tp='")
    try:
        layout_teacher.process_group_collection_class()
    except ValueError as exc:
        raise ValueError(f"{entry}: {exc}") from None


def build_role_at_layout(run_args: Any, role: str, tp: int, path: str, step: int | None,
                         residency: str = "resident") -> list[Any]:
    """The role's chunks built at TeacherLayout(tp=tp) from the Hugging Face directory `path`
    (checked first; a collective: every rank builds it) at `residency`, its vocabulary checked
    against the student's, chunk 0 tagged with the role as slime does."""
    from megatron_rl_patches.integrations.megatron.opd import (
        hf_teachers,  # lazy: import cost: torch (check_role_layout)
    )

    check_role_layout(run_args, role, tp, path, step)
    student = hf_teachers.student_vocab(run_args, getattr(run_args, "padded_vocab_size", None) or 0)
    chunks = hf_teachers.build_hf_teacher(run_args, path, residency, student, run_args,
                                          f"role {role!r}: weights {path!r}", layout=TeacherLayout(tp=tp))
    chunks[0].role = role
    logger.info("megatron-rl-patches: role %r built inference-only from the Hugging Face directory %s at its own "
                "layout (tp=%d, %s); slime's log-prob passes of it go through score_at_layout", role, path, tp,
                residency)
    return chunks
