"""`bench shared-prefix`'s door: the shape asked for (`--shape`) run by the module that measures it,
the dense GPT's shapes (`shared_prefix`: grpo, multi-turn), slime's model kinds
(`shared_prefix_models`: hybrid, deepseek, cp2, models) or a step past the micro-batch budget
(`shared_prefix_agentic`: agentic); `all`: every shape, each to its own files."""
from __future__ import annotations

from megatron_rl_patches.apps.bench import shared_prefix, shared_prefix_agentic, shared_prefix_models

ALL_SHAPES = (*shared_prefix.SHAPES, *shared_prefix_models.SHAPES, *shared_prefix_agentic.SHAPES, "all")


def run(quick: bool = False, out_dir: str | None = None, shape: str = "grpo") -> list[dict]:
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
