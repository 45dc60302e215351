"""Stand-in for slime.rollout.sglang_rollout (624b824a): the name its `generate_and_rm` calls
after each sample's generation, `apply_rollout_sample_hooks(args, value, **kwargs)` (slime's own
lives in slime.rollout.sample_hooks: each hook of --rollout-sample-hook-path on every sample of
`value`, here none). slime's real rollout runs in the slime lane
(tests/integrations/slime/lane/test_slime_opd_rollout_scores_lane.py)."""
from __future__ import annotations


async def apply_rollout_sample_hooks(args, value, **kwargs):
    return value
