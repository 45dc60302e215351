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

from megatron_rl_patches.ops._dist import tp_size
from megatron_rl_patches.ops.agreement import agree, local_error
from megatron_rl_patches.ops.kernels.invariant_tiles import check_vocab

VARIABLE = "MEGATRON_RL_PATCHES_INVARIANT"
_WORDS = {**dict.fromkeys(("1", "true", "on", "yes"), True), **dict.fromkeys(("0", "false", "off", "no"), False),
          "": None}


def environment_invariant(environ: dict[str, str] | None = None) -> bool | None:
    """The setting's value: True, False, or None when unset or ""; ValueError naming the variable
    for any other text."""
    text = (os.environ if environ is None else environ).get(VARIABLE) or ""
    setting = _WORDS.get(text.strip().lower(), "bad")
    if setting == "bad":
        raise ValueError(f"{VARIABLE}={text[:40]!r} is not a switch: use 1 (invariant vocabulary ops) or 0 (the "
                         f"default mode), or leave it unset")
    return setting  # type: ignore[return-value]


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


def deferred_invariant(invariant: object, config: Any) -> bool | None:
    """What a route holding a model config hands an op: `invariant` when a bool, None when the
    setting is given (the op reads it and agrees it over its group), else `config`'s
    ``batch_invariant_mode``: :func:`resolve_invariant`'s order, with no rank refusing alone."""
    check_invariant(invariant)
    if isinstance(invariant, bool):
        return invariant
    return None if (os.environ.get(VARIABLE) or "").strip() else config_invariant(config)


def agreed_invariant(invariant: object, op: str, group: Any) -> bool:
    """:func:`resolve_invariant` agreed over the tensor-parallel `group` (None: no tensor
    parallelism) before the op's first collective, since the two modes run different collectives:
    the setting on one rank only, or an argument one rank refuses, is the same error naming the
    ranks on every rank (ops.agreement; one small all-gather per call at tp > 1)."""
    if tp_size(group) == 1:
        return resolve_invariant(invariant)
    chosen, error = local_error(lambda: resolve_invariant(invariant))
    agree(group, op, error=error, match={f"the invariant mode (invariant= or {VARIABLE}; 1: on)": chosen},
          where="tp_group")
    return bool(chosen)


def resolve_for_vocab(invariant: object, vocab: int, op: str, group: Any = None) -> bool:
    """:func:`agreed_invariant` for an op over `vocab` ids: the invariant mode's fixed-point sums
    hold only so many ids (ValueError naming `op` beyond them)."""
    chosen = agreed_invariant(invariant, op, group)
    if chosen:
        check_vocab(vocab, op)
    return chosen

