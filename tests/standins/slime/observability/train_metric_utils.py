"""Stand-in for slime's `train_metric_utils.log_rollout_data` (624b824a): the same control flow
over the rollout data, written for the tests. On TP rank 0 of the last stage slime averages every
field outside its ignore sets: a list of tensors is concatenated and `.mean()`ed (an int64 or a
bool tensor fails there; tensors of different trailing shapes fail at the concatenation); a list
of numbers is summed; a tensor is averaged as float. The real function runs in the slime lane."""
from __future__ import annotations

import torch

IGNORED = {"tokens", "multimodal_train_inputs", "loss_masks", "sample_indices", "rollout_ids", "rollout_mask_sums",
           "rollout_top_p_token_ids", "rollout_top_p_token_offsets", "rollout_routed_experts", "global_batch_sizes",
           "num_microbatches", "micro_batch_indices", "source_names", "local_raw_reward"}


def log_rollout_data(rollout_id, args, rollout_data):
    """The per-field (sum, count) slime would reduce and log; returned for the tests to read."""
    logged = {}
    for key, value in rollout_data.items():
        if key in IGNORED:
            continue
        if isinstance(value, (list, tuple)):
            if isinstance(value[0], torch.Tensor):
                logged[key] = ((torch.cat(value).clone().detach().mean() * len(value)).item(), len(value))
            else:
                logged[key] = (sum(value), len(value))
        elif isinstance(value, torch.Tensor):
            logged[key] = (value.float().mean().item(), 1)
        else:
            raise ValueError(f"Unsupported type: {type(value)} for key: {key}")
    return logged
