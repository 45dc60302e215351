"""The `inference_roles` patch, slime's wrapper: slime's initialize_model_and_optimizer(args, role)
builds the roles listed in MEGATRON_RL_PATCHES_INFERENCE_ROLES (default: slime's teacher roles)
inference-only and returns (model, None, None, iteration) like upstream; every other role goes
through upstream unchanged. An entry `role:swap` or `role:stream` keeps that role's weights in
host memory (inference/residency/).

Assumptions about slime (slime.backends.megatron_utils.model, checked against its public code):
the module imports `get_model_provider_func(args, role)` (older releases: `(args)`) from
.model_provider and `load_checkpoint(model, optimizer, scheduler, checkpointing_context,
skip_load_to_model_and_opt)` from .checkpoint: the build is `integrations.megatron.opd.frozen_role`'s
(`frozen_role`: the weights' source, a Hugging Face directory of another architecture, `role;tp=N`
at its own layout, whose log-prob passes the `inference_roles` wrapper of slime's forward_only
scores there: layout_role_pass).
"""
# lazy imports: import cost: `doctor` imports this module (DEFAULT_INFERENCE_ROLES); a role's build loads on first call
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from megatron_rl_patches._log import warn_once
from megatron_rl_patches.integrations.megatron.opd.frozen_role import frozen_role
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
    chunks, iteration = frozen_role(run_args, role, module)
    return chunks, None, None, iteration
