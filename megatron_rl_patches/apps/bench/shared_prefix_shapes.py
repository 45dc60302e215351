"""`bench shared-prefix`'s door: the shape asked for (`--shape`) run by the module that measures it,
the dense GPT's shapes (`shared_prefix`: grpo, multi-turn), slime's model kinds
(`shared_prefix_models`: hybrid, deepseek, cp2, models) or a step past the micro-batch budget
(`shared_prefix_agentic`: agentic); `all`: every shape, each to its own files."""
from __future__ import annotations

from megatron_rl_patches.apps.bench import shared_prefix, shared_prefix_agentic, shared_prefix_models

ALL_SHAPES = (*shared_prefix.SHAPES, *shared_prefix_models.SHAPES, *shared_prefix_agentic.SHAPES, "all")
# Rough wall time of each shape's full run on an idle 2-core CPU (measured: cp2 0:54, models 2:27,
# multi-turn 5:05, grpo 7:07, agentic 23:12 under a load of 6-10, each without PrefixGrouper); the
# dense shapes run the peer's rows too where it is installed (`make bench-shared-prefix`), about twice as long
PEER_TIME = ", about twice that with PrefixGrouper installed"
DURATIONS = {"grpo": "7 min" + PEER_TIME, "multi-turn": "5 min" + PEER_TIME, "hybrid": "1 min",
             "deepseek": "1 min", "cp2": "1 min", "models": "2-3 min", "agentic": "20-25 min",
             "all": "40 min" + PEER_TIME}
DEFAULT = "grpo"


def duration(shape: str | None) -> str:
    """The rough wall time of `bench shared-prefix --shape SHAPE`'s full run (None: the default shape)."""
    return DURATIONS[shape or DEFAULT]


def run(quick: bool = False, out_dir: str | None = None, shape: str = DEFAULT) -> list[dict]:
    """Print the shape's table; write its files into `out_dir` when given (see each module's `run`)."""
    if shape == "all":
        return [row for one in (*shared_prefix.SHAPES, "models", *shared_prefix_agentic.SHAPES)
                for row in run(quick, out_dir, one)]
    if shape in shared_prefix_agentic.SHAPES:
        return shared_prefix_agentic.run(quick, out_dir, shape)
    if shape in shared_prefix_models.SHAPES:
        return shared_prefix_models.run(quick, out_dir, shape)
    if shape not in shared_prefix.SHAPES:
        raise ValueError(f"bench shared-prefix: shape must be one of {', '.join(ALL_SHAPES)}, got {shape!r}")
    return shared_prefix.run(quick, out_dir, shape)
