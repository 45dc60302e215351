"""The invariant mode's switch: whether a vocabulary op computes each row's values from that row's
input and the weights alone, bit for bit (docs/train-rollout-agreement.md).

An op's ``invariant=`` argument wins; None reads the setting ``MEGATRON_RL_PATCHES_INVARIANT``
("1"/"true"/"on"/"yes" on, "0"/"false"/"off"/"no" off, any case; unset or "" defers), then a
model config's ``batch_invariant_mode`` (megatron-core's TransformerConfig attribute) where a
processor or framework route has the config; else off.
"""
from __future__ import annotations

import os
from typing import Any

from megatron_rl_patches._variables import INVARIANT as VARIABLE
from megatron_rl_patches._variables import invariant_setting
from megatron_rl_patches.ops.kernels.invariant_tiles import check_vocab


def environment_invariant(environ: dict[str, str] | None = None) -> bool | None:
    """The setting's value: True, False, or None when unset or ""; ValueError naming the variable
    for any other text."""
    return invariant_setting((os.environ if environ is None else environ).get(VARIABLE))


def config_invariant(config: Any) -> bool:
    """megatron-core's ``batch_invariant_mode`` on a model config (False when absent or None)."""
    return getattr(config, "batch_invariant_mode", False) is True


def check_invariant(invariant: object) -> None:
    """An `invariant=` argument: True, False or None; TypeError naming it otherwise."""
    if invariant is not None and not isinstance(invariant, bool):
        raise TypeError(f"invariant must be True, False or None (the setting {VARIABLE} or the model config's "
                        f"batch_invariant_mode), got {invariant!r}")


def resolve_invariant(invariant: object, config: Any = None) -> bool:
    """Whether a call runs invariant: `invariant` when a bool, else the setting, else `config`'s
    ``batch_invariant_mode``; TypeError for anything but a bool or None."""
    check_invariant(invariant)
    if isinstance(invariant, bool):
        return invariant
    setting = environment_invariant()
    return setting if setting is not None else config_invariant(config)


def resolve_for_vocab(invariant: object, vocab: int, op: str) -> bool:
    """:func:`resolve_invariant` for an op over `vocab` ids: the invariant mode's fixed-point sums
    hold only so many ids (ValueError naming `op` beyond them)."""
    chosen = resolve_invariant(invariant)
    if chosen:
        check_vocab(vocab, op)
    return chosen
