"""How a served teacher's replicas share a step (`ReplicaSettings`): hedging and prompt groups.
Standard library only."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_rl_patches.teachers.finite import finite, shown, wait_seconds


@dataclass(frozen=True)
class ReplicaSettings:
    """How a teacher's replicas share a step (ignored with one URL).

    `hedge_after`: a sample whose request has waited this multiple of the step's median request
    time (its answered requests so far; never less than `hedge_floor_s`, always within the step's
    deadline) is sent again to another healthy replica; the first answer wins and the other is
    cancelled (its reply dropped, no retry). None: no hedging.

    `keep_prompt_groups`: the samples of one prompt (the same ids before their response start:
    a group of rollouts of one prompt) go to the replica the first of them went to, while it is
    healthy, so an engine with prefix caching computes the prompt once. Off by default: spreading
    by fewest requests in flight keeps every replica busy, and a group kept on one replica loads
    it unevenly (a group of long samples on one replica while another idles); turn it on where
    the prompts are long beside the responses and the engine caches prefixes (vLLM's
    `--enable-prefix-caching`)."""

    hedge_after: float | None = 3.0
    hedge_floor_s: float = 1.0
    keep_prompt_groups: bool = False

    def __post_init__(self) -> None:
        if self.hedge_after is not None and (not finite(self.hedge_after) or self.hedge_after < 1):
            raise ValueError(f"ReplicaSettings(hedge_after={shown(self.hedge_after)}) must be a finite multiple >= 1 "
                             f"of the step's median request time, or None (no hedging)")
        wait_seconds(f"ReplicaSettings(hedge_floor_s={shown(self.hedge_floor_s)})", self.hedge_floor_s, allow_zero=True)
        if not isinstance(self.keep_prompt_groups, bool):
            raise TypeError(f"ReplicaSettings(keep_prompt_groups=...) must be a bool, got "
                            f"{type(self.keep_prompt_groups).__name__}")
