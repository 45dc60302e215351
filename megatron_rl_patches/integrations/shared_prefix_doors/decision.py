"""A pass's verdict at a framework's door, and the one decision every door takes with it.

`pass_verdict` reads the table: the door rows this run has where the framework packs whole, then the
model's own refusals (one string: `shared_prefix_reason` / `config_reasons`), each with what to
change in the framework's words. `agreed_decision` is what every door calls before its pass's first
collective: each rank's door reasons gathered (the model's check gathers its own), so every rank
decides alike; then either the pass shares, or it packs each sample whole with one warning naming why
and what to change, or, under MEGATRON_RL_PATCHES_STRICT=1, the same words raise a ValueError on
every rank. slime's, verl's and NeMo-RL's passes say it in the same words (`WARNING`, `ERROR`)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from megatron_rl_patches._log import warn_once
from megatron_rl_patches.integrations.shared_prefix_doors.frameworks import OFF, framework
from megatron_rl_patches.integrations.shared_prefix_doors.table import FIXES, Layout, door_rows
from megatron_rl_patches.settings import SHARED_PREFIX, STRICT

WARNING = ("shared prefix: {what} runs each sample packed whole: {reasons} (" + OFF + " switches sharing off for this "
           "job, without this warning; " + STRICT + "=1 makes it an error)")
ERROR = (SHARED_PREFIX + "=1 with " + STRICT + "=1: {what} cannot pack a group's prompt once: {reasons}. Change what "
         "is named, or set " + OFF + " for this job (each sample packed whole)")
FIELD = re.compile(r"\((\w+)=")  # a refusal names its config field as "(name=value"


@dataclass(frozen=True)
class Reason:
    """Why a pass packs whole, and what to change in the framework's words ("" where nothing can)."""

    why: str
    change: str = ""

    def said(self) -> str:
        return f"{self.why} (to share: {self.change})" if self.change else self.why


def changes(framework_key: str, reason: str) -> str:
    """What a user of `framework_key` changes for the config fields `reason` (a model's refusal) names."""
    door = framework(framework_key)
    named = [fix for name in FIELD.findall(reason) for fix in FIXES.get(name, (name,))]
    return "; ".join(dict.fromkeys(door.change(name) for name in named))


def pass_verdict(framework_key: str, layout: Layout, model_reason: str | None = None,
                 extra: tuple[Reason, ...] = ()) -> list[Reason]:
    """Why a pass of `framework_key` at `layout` packs whole (empty: it shares): the door rows the run
    has where the table says packed whole, `extra` door reasons of the caller's, then the model's own
    refusal (`model_reason`, as `shared_prefix_reason` says it) with the framework's changes."""
    found = [Reason(cell.why, cell.change) for _, cell in door_rows(framework_key, layout)]
    found += list(extra)
    if model_reason:
        found.append(Reason(model_reason, changes(framework_key, model_reason)))
    return found


def said(reasons: list[Reason]) -> str:
    return "; ".join(dict.fromkeys(reason.said() for reason in reasons))


def agreed_decision(framework_key: str, what: str, model: Any, *, training: bool, layout: Layout, strict: bool,
                    extra: tuple[Reason, ...] = ()) -> bool:
    """Whether the pass `what` shares: the door's reasons (`layout`'s rows, `extra`) gathered over every
    rank, the model's check agreed over every rank; every rank calls it before the pass's first
    collective and decides alike. Packed whole: one warning naming why and what to change (False), or a
    ValueError on every rank under `strict` (MEGATRON_RL_PATCHES_STRICT=1)."""
    # lazy: import cost (torch, megatron-core): doctor and `shared-prefix check` read this module without them
    from megatron_rl_patches.ops.agreement import gathered_objects, world
    from megatron_rl_patches.shared_prefix import shared_prefix_reason  # lazy: import cost (torch, megatron-core)

    mine = [(r.why, r.change) for r in pass_verdict(framework_key, layout, extra=extra)]
    every = gathered_objects(world(), mine)
    door = [Reason(*pair) for reasons in every for pair in (reasons or [])]  # type: ignore[attr-defined]
    model_reason = shared_prefix_reason(model, training=training)
    reasons = sorted(set(door), key=lambda r: (r.why, r.change))
    if model_reason:
        reasons.append(Reason(model_reason, changes(framework_key, model_reason)))
    if not reasons:
        return True
    if strict:
        raise ValueError(ERROR.format(what=what, reasons=said(reasons)))
    warn_once(WARNING.format(what=what, reasons=said(reasons)))
    return False
