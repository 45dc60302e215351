"""A frozen role of MEGATRON_RL_PATCHES_INFERENCE_ROLES (a teacher, a reward model) built
inference-only on the actor's split for any Megatron host: no grad buffer, no optimizer, at the
entry's residency; from a Hugging Face directory of another architecture than the actor's by its
own config.json (`hf_role`), or from the host's model provider with the weights its loader reads
(`provider_role`). At its own layout (`role;tp=N`): `layout_role`. `frozen_role` picks among them for
a host whose model module has Megatron-LM's `get_model_provider_func(args, role)` (older: `(args)`)
and `load_checkpoint(model, optimizer, scheduler, checkpointing_context, skip_load_to_model_and_opt)`
(slime's, handed over by `integrations.slime.roles`), its weights where `weights_source` says."""
# lazy imports: optional dependency megatron-core (a role's build)
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from megatron_rl_patches._log import logger
from megatron_rl_patches.patching import env


def weights_source(run_args: Any, role: str) -> tuple[str, int | None]:
    """(path, iteration or None) a frozen role loads its weights from: `args.<role>_load` when set
    (at `<role>_ckpt_step`), else `args.load` (slime's forks copy the teacher's path there), else
    `args.pretrained_checkpoint`."""
    own = getattr(run_args, f"{role}_load", None)
    if own:
        return own, getattr(run_args, f"{role}_ckpt_step", None)
    if getattr(run_args, "load", None):
        return run_args.load, getattr(run_args, "ckpt_step", None)
    if getattr(run_args, "pretrained_checkpoint", None):
        return run_args.pretrained_checkpoint, None
    raise ValueError(f"role {role!r} is built inference-only ({env.INFERENCE_ROLES}) but has no weights to load: "
                     f"set args.{role}_load or args.load to its checkpoint (a frozen model with random weights "
                     "is never what you want)")


def frozen_role(run_args: Any, role: str, module: Any) -> tuple[list[Any], int]:
    """(chunks, iteration) of `role` built inference-only with the host's model `module` (its
    provider factory and loader): at its own layout (`role;tp=N`), from a Hugging Face directory of
    another architecture, else from the provider with the checkpoint's weights (a foreign directory,
    e.g. a Hugging Face one the host converts itself, through the host's `load_checkpoint`)."""
    from megatron_rl_patches.inference.loading.paths import resolve_checkpoint

    path, step = weights_source(run_args, role)
    residency = env.role_residencies().get(role, "resident")
    tp = env.role_layouts().get(role)
    if tp is not None:  # `role;tp=N`: at its own layout (layout_role; its passes: layout_role_pass)
        from megatron_rl_patches.integrations.megatron.opd.layout_role import build_role_at_layout

        return build_role_at_layout(run_args, role, tp, path, step, residency), 0
    if step is None:
        built = hf_role(run_args, role, path, residency)
        if built is not None:
            return built, 0
    if not _delegated(path, step, module):
        resolve_checkpoint(path, step)  # a wrong path fails before the model is built
    return provider_role(_provider(module.get_model_provider_func, run_args, role), run_args, role, residency,
                         lambda chunks: _load(chunks, run_args, path, step, module))


def _provider(factory: Callable[..., Any], run_args: Any, role: str) -> Callable[..., Any]:
    try:
        takes_role = len(inspect.signature(factory).parameters) >= 2
    except (TypeError, ValueError):
        takes_role = True
    return factory(run_args, role) if takes_role else factory(run_args)


def _load(chunks: list[Any], run_args: Any, path: str, step: int | None, module: Any) -> int:
    from megatron_rl_patches.inference.loading.weights import load_inference_weights

    if _delegated(path, step, module):
        # Not a Megatron checkpoint (e.g. a HuggingFace directory: slime loads those through
        # megatron-bridge in its load_checkpoint, which reads args.load): delegate, no optimizer.
        saved = getattr(run_args, "load", None)
        run_args.load = path
        try:
            result = module.load_checkpoint(chunks, None, None, {}, False)
        finally:
            run_args.load = saved
        return int(result[0] if isinstance(result, tuple) else result or 0)
    return load_inference_weights(chunks, path, strict=True, iteration=step)


def _delegated(path: str, step: int | None, module: Any) -> bool:
    from megatron_rl_patches.inference.loading.paths import is_foreign_directory

    return step is None and callable(getattr(module, "load_checkpoint", None)) and is_foreign_directory(path)


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
