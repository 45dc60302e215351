"""A frozen role of MEGATRON_RL_PATCHES_INFERENCE_ROLES (a teacher, a reward model) built
inference-only on the actor's split for any Megatron host: no grad buffer, no optimizer, at the
entry's residency; from a Hugging Face directory of another architecture than the actor's by its
own config.json (`hf_role`), or from the host's model provider with the weights its loader reads
(`provider_role`). At its own layout (`role;tp=N`): `layout_role`. The host decides the loading and
supplies the provider and the loader (slime: `integrations.slime.roles`)."""
# lazy imports: optional dependency megatron-core (a role's build)
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_rl_patches._log import logger


def hf_role(run_args: Any, role: str, path: str, residency: str) -> list[Any] | None:
    """The role's chunks built from the Hugging Face directory `path` by its own config.json when
    it differs from the actor's architecture (the host's provider and loader build the actor's), its
    vocabulary checked against the student's first; None for any other path."""
    from megatron_rl_patches.integrations.megatron.opd import hf_teachers

    what = f"role {role!r}: weights {path!r}"
    loading, differences = hf_teachers.teacher_loading(path, run_args, what)
    if loading != hf_teachers.HF:
        return None
    hf_teachers.check_allgather_cp(run_args, what)  # megatron-core's thd RoPE cuts in zigzag
    student = hf_teachers.student_vocab(run_args, getattr(run_args, "padded_vocab_size", None) or 0)
    chunks = hf_teachers.build_hf_teacher(run_args, path, residency, student, run_args, what)
    chunks[0].role = role
    logger.info("megatron-rl-patches: role %r built inference-only from the Hugging Face directory %s (%s; %s)",
                role, path, "; ".join(differences), residency)
    return chunks


def provider_role(provider: Callable[..., Any], run_args: Any, role: str, residency: str,
                  load: Callable[[list[Any]], int]) -> tuple[list[Any], int]:
    """The role's chunks built inference-only from `provider`, their weights read by `load` (the
    iteration it gives; 0 with `--finetune`, as Megatron-LM's load_checkpoint reports then)."""
    from megatron.core.enums import ModelType  # lazy: optional dependency megatron-core

    from megatron_rl_patches.inference.build import build_inference_model
    from megatron_rl_patches.inference.residency.placement import weights_on_host

    chunks: list[Any] = build_inference_model(provider, model_type=ModelType.encoder_or_decoder, residency=residency)
    with weights_on_host(chunks):  # swap/stream: the host's own loader (delegated) writes the host copies too
        iteration = load(chunks)
    chunks[0].role = role  # slime tags chunk 0 with its role for logging
    if getattr(run_args, "finetune", False):  # Megatron-LM's load_checkpoint reports 0 then too
        iteration = 0
    logger.info(
        "megatron-rl-patches: role %r built inference-only (%d chunk(s), no grad buffer, no optimizer, %s)",
        role,
        len(chunks),
        residency,
    )
    return chunks, iteration
