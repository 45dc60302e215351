"""The invariant mode's switch: whether a vocabulary op computes each row's values from that row's
input and the weights alone, bit for bit (docs/train-rollout-agreement.md).

Resolved once, at the public entry (an op, a processor, a framework route), into a bool that
travels down in the op's spec: an op's ``invariant=`` argument wins; None reads the setting
``MEGATRON_RL_PATCHES_INVARIANT`` ("1"/"true"/"on"/"yes" on, "0"/"false"/"off"/"no" off, any case;
unset or "" defers), then the ``batch_invariant_mode`` of the model config the entry was given
(megatron-core's TransformerConfig attribute); else off. Internal code takes bools only.
"""
from __future__ import annotations

import os
from typing import Any

VARIABLE = "MEGATRON_RL_PATCHES_INVARIANT"
_WORDS = {**dict.fromkeys(("1", "true", "on", "yes"), True), **dict.fromkeys(("0", "false", "off", "no"), False),
          "": None}


# the invariant tiles' 64-bit fixed-point sums (kernels.invariant_tiles.FIXED_BITS) hold this many ids
MAX_VOCAB = 1 << 19


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


def check_vocab(vocab: int, op: str) -> None:
    """The fixed-point sums hold vocabularies up to 2^19 ids."""
    if vocab > MAX_VOCAB:
        raise ValueError(f"{op}(invariant=True) sums in 64-bit fixed point, for vocabularies up to {MAX_VOCAB} ids; "
                         f"this one has {vocab}: call it with invariant=False")


def resolve_for_vocab(invariant: object, vocab: int, op: str, config: Any = None) -> bool:
    """:func:`resolve_invariant` for an op over `vocab` ids: the invariant mode's fixed-point sums
    hold only so many ids (ValueError naming `op` beyond them)."""
    chosen = resolve_invariant(invariant, config)
    if chosen:
        check_vocab(vocab, op)
    return chosen
