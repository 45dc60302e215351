"""A call's arguments as a shared-prefix seam reads them: the plan a `packed_seq_params` carries
(`plan_in`), and one call's arguments read and replaced by name, by position or keyword (`Call`),
for the hooks of every seam (model_hooks, mla, moe_statistics, mtp)."""
from __future__ import annotations

import functools
import inspect
from typing import Any

from megatron_rl_patches.shared_prefix.plan import SharedPrefixPlan


def plan_in(params: Any) -> SharedPrefixPlan | None:
    """The plan a `packed_seq_params` carries, or None (ordinary packing, or none)."""
    plan = getattr(params, "shared_prefix", None)
    return plan if isinstance(plan, SharedPrefixPlan) else None


@functools.cache
def _positions(cls: Any) -> dict[str, int]:
    """Each positional parameter's index in a call of `cls.forward` (self left out); the signature
    is the unwrapped one (a wrapt patch of the forward, like `gpt_output_processor`, takes keywords the
    original does not, and passes them on: those never move)."""
    parameters = list(inspect.signature(cls.forward).parameters.values())[1:]
    return {p.name: i for i, p in enumerate(parameters) if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)}


class Call:
    """One call's arguments read and replaced by name, whether passed by position or by keyword."""

    def __init__(self, module: Any, args: tuple, kwargs: dict):
        self.args, self.kwargs = list(args), dict(kwargs)
        self.index = _positions(module.__class__)

    def get(self, name: str) -> Any:
        if name in self.kwargs:
            return self.kwargs[name]
        index = self.index.get(name)
        return self.args[index] if index is not None and index < len(self.args) else None

    def set(self, name: str, value: Any) -> None:
        index = self.index.get(name)
        if name not in self.kwargs and index is not None and index < len(self.args):
            self.args[index] = value
        else:
            self.kwargs[name] = value

    def done(self) -> tuple[tuple, dict]:
        return tuple(self.args), self.kwargs
