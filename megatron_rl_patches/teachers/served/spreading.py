"""How a teacher's replicas share the samples: a policy object (`ReplicaSettings(spread=...)`)
that picks one replica for a sample among the healthy ones it may go to, from their requests in
flight and what the pool remembers of its earlier picks (`Placements`). `FewestInFlight` (the
default) keeps every replica busy; `PromptAffinity` keeps the samples of one prompt together.
Standard library only."""
from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field


@dataclass
class Placements:
    """What a pool remembers of its picks, for its policy: whose turn a tie is (it goes round
    the replicas) and which replica each prompt went to."""

    turn: int = 0
    homes: dict[Hashable, int] = field(default_factory=dict)


@dataclass(frozen=True)
class FewestInFlight:
    """The replica with the fewest requests in flight; ties go round the replicas."""

    def choose(self, loads: Mapping[int, int], replicas: int, prompt: Hashable | None,
               placements: Placements) -> int:
        """One of `loads` (replica index -> its requests in flight; never empty) of the pool's
        `replicas`; `prompt`: the sample's ids before its response (None for a hedged copy)."""
        turn = placements.turn
        placements.turn += 1
        return min(loads, key=lambda replica: (loads[replica], (replica - turn) % replicas))


@dataclass(frozen=True)
class PromptAffinity(FewestInFlight):
    """The samples of one prompt (the same ids before their response start: a group of rollouts
    of one prompt) go to the replica the first of them went to while it is healthy; a new prompt
    goes to the replica with the fewest requests in flight.

    On stock vLLM 0.32 it saves no compute: vLLM turns prefix-cache reads off for requests with
    prompt log-probs and for all-token pooling (`skip_reading_prefix_cache`), the two routes a
    served teacher asks, even with `--enable-prefix-caching` (the served lane reads its `/metrics`);
    there it buys one server's numerics for a whole group, and a group failed over together, and
    loads the replicas unevenly. On `megatron-rl-patches serve-teacher` replicas it is what lets
    the replica holding a group compute its prompt once (the default there)."""

    def choose(self, loads: Mapping[int, int], replicas: int, prompt: Hashable | None,
               placements: Placements) -> int:
        home = placements.homes.get(prompt) if prompt is not None else None
        if home is not None and home in loads:
            return home
        chosen = super().choose(loads, replicas, prompt, placements)
        if prompt is not None:
            placements.homes[prompt] = chosen
        return chosen
