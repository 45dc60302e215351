"""The `inference_roles` patch, slime's wrapper: slime's initialize_model_and_optimizer(args, role)
builds the roles listed in MEGATRON_RL_PATCHES_INFERENCE_ROLES (default: slime's teacher roles)
inference-only and returns (model, None, None, iteration) like upstream; every other role goes
through upstream unchanged. An entry `role:swap` or `role:stream` keeps that role's weights in
host memory (inference/residency/).

Assumptions about slime (slime.backends.megatron_utils.model, checked against its public code):
the module imports `get_model_provider_func(args, role)` (older releases: `(args)`) from
.model_provider and `load_checkpoint(model, optimizer, scheduler, checkpointing_context,
skip_load_to_model_and_opt)` from .checkpoint; a frozen role's weights come from
`args.<role>_load` when set, else `args.load` (slime's forks copy the teacher's path there),
else `args.pretrained_checkpoint`. A Hugging Face directory whose config.json differs from the
actor's architecture is built from its own config.json (`build_inference_model_from_hf`); an entry
`role;tp=N` builds it at its own tensor-parallel layout (layout_role), and the `inference_roles`
wrapper of slime's forward_only scores its log-prob passes there (layout_role_pass).
"""
# lazy imports: import cost: `doctor` imports this module (DEFAULT_INFERENCE_ROLES); a role's build loads on first call
from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megatron_rl_patches._log import warn_once
from megatron_rl_patches.integrations.megatron.opd.frozen_role import hf_role, provider_role
from megatron_rl_patches.model.arguments import bind
from megatron_rl_patches.patching import env

if TYPE_CHECKING:
    from collections.abc import Mapping

# slime's frozen roles, built inference-only when MEGATRON_RL_PATCHES_INFERENCE_ROLES is unset.
DEFAULT_INFERENCE_ROLES = ("prm_teacher", "teacher")


def inference_roles(environ: Mapping[str, str] | None = None) -> list[str]:
    """Roles built inference-only: those MEGATRON_RL_PATCHES_INFERENCE_ROLES lists; unset means
    the default teacher roles, '' means none."""
    names = env.checked_role_names(environ)  # a wrong value is a ValueError naming the variable, as at start-up
    return list(DEFAULT_INFERENCE_ROLES) if names is None else names


def _provider(factory: Callable[..., Any], run_args: Any, role: str) -> Callable[..., Any]:
    try:
        takes_role = len(inspect.signature(factory).parameters) >= 2
    except (TypeError, ValueError):
        takes_role = True
    return factory(run_args, role) if takes_role else factory(run_args)


def weights_source(run_args: Any, role: str) -> tuple[str, int | None]:
    """(path, iteration or None) a frozen role loads its weights from."""
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


def initialize_model_and_optimizer_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of slime's initialize_model_and_optimizer(args, role="actor")."""
    bound = bind(wrapped, args, kwargs)
    if bound is None:
        return wrapped(*args, **kwargs)
    run_args, role = bound.arguments.get("args"), bound.arguments.get("role")
    if role not in inference_roles():
        return wrapped(*args, **kwargs)
    module = sys.modules.get(getattr(wrapped, "__module__", ""))
    factory = getattr(module, "get_model_provider_func", None)
    if not callable(factory):
        warn_once(f"'inference_roles': {getattr(module, '__name__', '?')} has no get_model_provider_func; "
                  f"role {role!r} is built trainable, as upstream does")
        return wrapped(*args, **kwargs)
    from megatron_rl_patches.inference.loading.paths import resolve_checkpoint

    path, step = weights_source(run_args, role)
    residency = env.role_residencies().get(role, "resident")
    tp = env.role_layouts().get(role)
    if tp is not None:  # `role;tp=N`: at its own layout (layout_role; its passes: layout_role_pass)
        from megatron_rl_patches.integrations.megatron.opd.layout_role import build_role_at_layout

        return build_role_at_layout(run_args, role, tp, path, step, residency), None, None, 0
    if step is None:
        built = hf_role(run_args, role, path, residency)
        if built is not None:
            return built, None, None, 0
    if not _delegated(path, step, module):
        resolve_checkpoint(path, step)  # a wrong path fails before the model is built
    chunks, iteration = provider_role(_provider(factory, run_args, role), run_args, role, residency,
                                      lambda chunks: _load(chunks, run_args, path, step, module))
    return chunks, None, None, iteration
