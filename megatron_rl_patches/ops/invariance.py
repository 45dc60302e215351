"""The invariant mode's switch: whether a vocabulary op computes each row's values from that row's
input and the weights alone, bit for bit (docs/train-rollout-agreement.md).

Resolved once, at the public entry (an op, a processor, a framework route), into a bool that
travels down in the op's spec: an op's ``invariant=`` argument wins; None reads the setting
``MEGATRON_RL_PATCHES_INVARIANT`` ("1"/"true"/"on"/"yes" on, "0"/"false"/"off"/"no" off, any case;
unset or "" defers), then the ``batch_invariant_mode`` of the model config the entry was given
(megatron-core's TransformerConfig attribute); else off. Internal code takes bools only.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from megatron_rl_patches import settings
from megatron_rl_patches.ops._checks import check_group
from megatron_rl_patches.ops._dist import tp_size
from megatron_rl_patches.ops.agreement import Value, agree, local_error
from megatron_rl_patches.settings import BACKEND as BACKEND_VARIABLE
from megatron_rl_patches.settings import INVARIANT as VARIABLE

T = TypeVar("T")

# The largest vocabulary the invariant tiles' 64-bit fixed-point sums (kernels.invariant_tiles.FIXED_BITS
# = 44) serve: a row of 2^19 ids all at its max (a uniform row whose sum covers every column; at TP = 2
# the all-reduce of two 2^18 shards) sums to 2^63, past int64.
MAX_VOCAB = (1 << 19) - 1


def environment_invariant(environ: dict[str, str] | None = None) -> bool | None:
    """The setting's value: True, False, or None when unset or ""; ValueError naming the variable
    for any other text."""
    return settings.invariant(environ)


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
    """The fixed-point sums hold vocabularies up to 2^19 − 1 ids (MAX_VOCAB)."""
    if vocab > MAX_VOCAB:
        raise ValueError(f"{op}(invariant=True) sums in 64-bit fixed point, for vocabularies up to {MAX_VOCAB} ids; "
                         f"this one has {vocab}: call it with invariant=False")


def deferred_invariant(invariant: object, config: Any) -> bool | None:
    """What a route holding a model config hands an op: `invariant` when a bool, None when the
    setting is given (the op reads it and agrees it over its group), else `config`'s
    ``batch_invariant_mode``: :func:`resolve_invariant`'s order, with no rank refusing alone."""
    check_invariant(invariant)
    if isinstance(invariant, bool):
        return invariant
    return None if environment_invariant() is not None else config_invariant(config)


def agreed_invariant(invariant: object, op: str, group: Any, config: Any = None,
                     match: Mapping[str, Value] | None = None) -> bool:
    """:func:`resolve_invariant` agreed over the tensor-parallel `group` (None: no tensor
    parallelism) before the op's first collective, since the two modes run different collectives:
    the setting on one rank only, or an argument one rank refuses, is the same error naming the
    ranks on every rank (ops.agreement; one small all-gather per call at tp > 1). `match`: the
    op's other arguments that must be the same on every rank (`_checks.collective_values`),
    matched in the same all-gather."""
    return agreed_route(invariant, op, group, _no_kernels, config=config, match=match)[0]


def _no_kernels(mode: bool) -> None:
    """For a caller that resolves only the mode: nothing to agree about kernels."""


def agreed_route(invariant: object, op: str, group: Any, pick: Callable[[bool], T],
                 vocab: int | None = None, config: Any = None,
                 match: Mapping[str, Value] | None = None) -> tuple[bool, T]:
    """The mode (:func:`agreed_invariant`) and the kernels `pick(mode)` chooses for it (a backend:
    its `name` and class), agreed in the same all-gather: a backend chosen on one rank only (its
    `backend=` or the backend variable) runs other collectives, and one rank's refusal of it (a
    backend that cannot run there) would leave the others waiting. `vocab`: checked against the
    invariant mode's limit (:func:`check_vocab`). `match`: as :func:`agreed_invariant`'s."""
    check_group(group)  # a group without torch.distributed: the op's own refusal, on this rank alone

    def local() -> tuple[bool, T]:
        chosen = resolve_invariant(invariant, config)
        if chosen and vocab is not None:
            check_vocab(vocab, op)
        return chosen, pick(chosen)

    if tp_size(group) == 1:
        return local()
    route, error = local_error(local)
    chosen, kernels = route if route is not None else (None, None)
    matched: dict[str, Value] = {f"the invariant mode (invariant= or {VARIABLE}; 1: on)": chosen, **(match or {})}
    if pick is not _no_kernels:
        matched[f"the kernels (backend= or {BACKEND_VARIABLE})"] = (
            None if kernels is None else f"{getattr(kernels, 'name', '')} ({type(kernels).__name__})")
    agree(group, op, error=error, match=matched, where="tp_group")
    return bool(chosen), kernels  # type: ignore[return-value]  # agreed: no rank failed


def resolve_for_vocab(invariant: object, vocab: int, op: str, group: Any = None, config: Any = None,
                      match: Mapping[str, Value] | None = None) -> bool:
    """:func:`agreed_invariant` for an op over `vocab` ids: the invariant mode's fixed-point sums
    hold only so many ids (ValueError naming `op` beyond them)."""
    return agreed_route(invariant, op, group, _no_kernels, vocab=vocab, config=config, match=match)[0]
