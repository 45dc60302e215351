"""Which target gets which wrapper, per framework. Declarations only: importing these
modules imports nothing heavy; the wrappers are named as "module:function" strings and are
resolved when their target module is imported."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_rl_patches.patching.registry import Patch


def train_reentry_patches(module: str, train_params: tuple[str, ...], framework: str) -> tuple[Patch, ...]:
    """`train_reentry` for a framework module that defines train() and the module-level
    enable/disable_forward_pre_hook(model_chunks) helpers (Megatron-LM and slime both do).
    Frameworks ship no usable version metadata: the parameter lists are the guard."""
    from megatron_rl_patches.patching.registry import Patch

    def record(attribute: str, wrapper: str, description: str, params: tuple[str, ...]) -> Patch:
        return Patch(
            name="train_reentry",
            target=f"{module}:{attribute}",
            wrapper=f"megatron_rl_patches.reentrant:{wrapper}",
            description=f"{framework} {description}",
            requires=None,
            params=params,
        )

    return (
        record("train", "train_wrapper", "train() callable once per rollout", train_params),
        record("enable_forward_pre_hook", "enable_hooks_helper_wrapper",
               "enable_forward_pre_hook(model_chunks) idempotent", ("model_chunks",)),
        record("disable_forward_pre_hook", "disable_hooks_helper_wrapper",
               "disable_forward_pre_hook(model_chunks, param_sync) idempotent", ("model_chunks",)),
    )


def all_patches() -> list[Patch]:
    from megatron_rl_patches.integrations import megatron_core, megatron_lm, slime

    return [*megatron_core.PATCHES, *megatron_lm.PATCHES, *slime.PATCHES, *megatron_core.OUTPUT_PROCESSOR_PATCHES]
