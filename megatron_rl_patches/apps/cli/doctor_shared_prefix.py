"""`doctor`'s shared-prefix verdict: one line per framework door (slime, verl, NeMo-RL), from the
patch selection (MEGATRON_RL_PATCHES, its DISABLE list) and the settings table alone, so it is the
same on any machine whether or not the framework is importable there. A door whose patch is selected
shares its passes (a pass that cannot share packs whole with one warning, or raises under
MEGATRON_RL_PATCHES_STRICT=1: `integrations/shared_prefix_doors`); one whose patch is not selected
says so and what to change. A problem only where the setting is on and no door's patch will apply."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_rl_patches.integrations.shared_prefix_doors.frameworks import FRAMEWORKS
from megatron_rl_patches.patching import env
from megatron_rl_patches.settings import SHARED_PREFIX, STRICT

NotSelected = Callable[[dict[str, Any], str, dict[str, str | None]], "tuple[str, str] | None"]
DOORS = [door for door in FRAMEWORKS.values() if door.patch is not None]


def door_verdicts(environment: dict[str, Any], fates: dict[str, str | None], not_selected: NotSelected) -> dict:
    """{framework key: {"title", "patch", "selected", "verdict"}} for every framework door, with the setting on."""
    strict = bool(environment.get("strict"))
    fallback = (f"a pass that cannot share raises a ValueError on every rank ({STRICT}=1)" if strict
                else "a pass that cannot share packs each sample whole with one warning naming why")
    verdicts = {}
    for door in DOORS:
        assert door.patch is not None
        why = not_selected(environment, door.patch, fates)
        verdict = (f"shares ({', '.join(door.passes)}); {fallback}" if why is None
                   else f"packs whole: patch {door.patch} is not selected ({why[0]}; for a {door.key} job: {why[1]})")
        verdicts[door.key] = {"title": door.title, "patch": door.patch, "selected": why is None, "verdict": verdict}
    return verdicts


def shared_prefix_statement(environment: dict[str, Any], shown: Callable[[str], str]) -> list[str]:
    """The report's shared-prefix lines: whether the setting is on (its value as set), then each door's verdict."""
    written = environment["variables"][env.SHARED_PREFIX]
    if environment.get("shared_prefix") is None:
        return ["shared prefix: unreadable (see the problems below)"]
    if not environment["shared_prefix"]:
        return [f"shared prefix: off ({'unset' if written is None else f'{SHARED_PREFIX}={shown(written)!r}'})"]
    doors = environment.get("shared_prefix_doors") or {}
    head = f"shared prefix: on ({SHARED_PREFIX}={shown(written)!r}), per framework:"
    return [head] + [f"  {door['title']}: {door['verdict']}" for door in doors.values()]


def shared_prefix_problems(environment: dict[str, Any], shown: Callable[[str], str]) -> list[str]:
    """The setting on while no framework door's patch will apply: every sample packed whole in any job."""
    doors = environment.get("shared_prefix_doors") or {}
    if not environment.get("shared_prefix") or not doors or any(door["selected"] for door in doors.values()):
        return []
    written = shown(environment["variables"][env.SHARED_PREFIX])
    patches = ", ".join(door["patch"] for door in doors.values())
    return [f"{SHARED_PREFIX}={written!r} takes effect through a framework's patch ({patches}), none of which will "
            f"apply, so every sample is packed whole in any job: " + "; ".join(
                f"{door['title']}: {door['verdict'].removeprefix('packs whole: ')}" for door in doors.values())]
