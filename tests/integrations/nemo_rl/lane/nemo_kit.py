"""Helpers for the NeMo-RL lane: NeMo-RL's config dicts and batches, its own Megatron driver
(`megatron_forward_backward` over `get_microbatch_iterator`) on a tiny GPTModel, float64 references."""
from __future__ import annotations

from typing import Any

import torch

VOCAB, BATCH, SEQ, K = 160, 4, 16, 8  # VOCAB (and VOCAB / 2) unlike any layer width (hidden 32, MLP 128)
LENGTHS = (16, 11, 7, 13)
TEMPERATURE = 0.8
CHUNK = 4  # NeMo-RL's logprob_chunk_size: its own logits path still holds [b, s, V/tp] logits
TOL = 1e-6  # patched against NeMo-RL's own fp32 path
CONTROL = 1e-3  # what a negative control must at least be off by


def policy_cfg(packed: bool = False, tp: int = 1, sp: bool = False, pp: int = 1, cp: int = 1,
               fuse_loss: bool = False) -> dict:
    """The PolicyConfig keys NeMo-RL's data and train modules read (sequences padded to NeMo-RL's
    minimum factor: 2·cp, times tp under sequence parallelism)."""
    return {
        "sequence_packing": {"enabled": packed, "fuse_loss": fuse_loss},
        "dynamic_batching": {"enabled": False},
        "megatron_cfg": {"context_parallel_size": cp, "tensor_model_parallel_size": tp, "sequence_parallel": sp,
                         "pipeline_model_parallel_size": pp},
        "make_sequence_length_divisible_by": (2 * cp if cp > 1 else 1) * (tp if sp else 1),
        "logprob_chunk_size": CHUNK,
    }


def packable(data: Any, mbs: int) -> Any:
    """`data` split into micro-batches of `mbs` samples for NeMo-RL's packing iterator (what its
    shard_by_batch_size sets with sequence packing)."""
    data.micro_batch_indices = [[[start, start + mbs] for start in range(0, BATCH, mbs)]]
    data.micro_batch_lengths = [[SEQ] * (BATCH // mbs)]
    return data


def batch(seed: int = 0, k: int = K, teacher: Any = None) -> Any:
    """A NeMo-RL BatchedDataDict: ids [B, S] (padded past each length), masks, GRPO's fields and,
    with `teacher` (its top-k log-probs, ids), the distillation fields."""
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(LENGTHS)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    inside = torch.arange(SEQ)[None] < lengths[:, None]
    ids = torch.where(inside, ids, torch.zeros_like(ids))
    token_mask = inside.float()
    token_mask[:, :3] = 0  # the prompt
    data = {
        "input_ids": ids, "input_lengths": lengths, "token_mask": token_mask, "sample_mask": torch.ones(BATCH),
        "advantages": torch.randn(BATCH, SEQ, generator=gen),
        "prev_logprobs": -torch.rand(BATCH, SEQ, generator=gen) * 4 - 2,
        "generation_logprobs": -torch.rand(BATCH, SEQ, generator=gen) * 4 - 2,
        "reference_policy_logprobs": -torch.rand(BATCH, SEQ, generator=gen) * 4 - 2,
    }
    if teacher is not None:
        data["teacher_topk_logits"], data["teacher_topk_indices"] = teacher
    return BatchedDataDict(data)


def valid_counts(data: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """global_valid_seqs, global_valid_toks as NeMo-RL's process_global_batch counts them (one DP rank)."""
    return data["sample_mask"].sum(), (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()


def drive(model: Any, data: Any, cfg: dict, post: Any, mbs: int = BATCH, forward_only: bool = True,
          temperature: float = 1.0) -> list:
    """NeMo-RL's own driver: its micro-batch iterator (data.py) and megatron_forward_backward (train.py)."""
    from nemo_rl.algorithms.logits_sampling_utils import TrainingSamplingParams
    from nemo_rl.models.megatron.data import get_microbatch_iterator
    from nemo_rl.models.megatron.train import megatron_forward_backward

    if cfg["sequence_packing"]["enabled"]:
        data = packable(data, mbs)
    iterator, count, micro, seq_dim, padded = get_microbatch_iterator(data, cfg, mbs, straggler_timer=None)
    params = TrainingSamplingParams(temperature=temperature) if temperature != 1.0 else None
    seqs, toks = valid_counts(data)
    return megatron_forward_backward(model=model, data_iterator=iterator, num_microbatches=count, seq_length=padded,
                                     mbs=micro, post_processing_fn=post, forward_only=forward_only,
                                     global_valid_seqs=seqs, global_valid_toks=toks, sampling_params=params)
