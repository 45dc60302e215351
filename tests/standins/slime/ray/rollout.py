"""Stand-in for slime.ray.rollout (624b824a): the rollout manager's per-rank split of the training
data, the schedule and the per-rank packaging it calls, and the rollout metrics' function it imports by name,
with slime's signatures; their behaviour is tested on a
copy of slime's split (tests/integrations/slime/test_slime_contexts.py), and on slime's own module in
the slime lane (tests/integrations/slime/lane/test_slime_rollout_split_lane.py, ray and SGLang as
inert stand-ins there)."""
from __future__ import annotations


def tensorize_rollout_data_for_training(rollout_data):
    raise LookupError("tensorize_rollout_data_for_training: slime's own needs ray")


def build_dp_schedule(args, train_parallel_config, total_lengths, *, global_batch_size, rollout_indices):
    raise LookupError("build_dp_schedule: slime's own runs in the slime lane")


def log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    """slime's rollout metrics (slime.observability.rollout_metrics, imported here by name): the
    extra metrics first, as its log_dict starts; returned for the tests to read."""
    return {**(rollout_extra_metrics or {})}


class RolloutManager:
    def _split_train_data_by_dp(self, data):
        raise LookupError("RolloutManager._split_train_data_by_dp: slime's own needs ray")
