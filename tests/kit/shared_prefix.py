"""Micro-batches shaped as GRPO packs them (groups of samples sharing a prompt, samples alone,
padding) or as an agent's multi-turn trajectories branch (a tree of shared turns), run on a
megatron-core model two ways: the ordinary packed (`thd`) forward and the
shared-prefix plan's, with what a test compares (per-token log-probs and entropy of the sample
rows, an objective over them, the tokens the embedding saw)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PackedBatch:
    """One packed micro-batch: `tokens` / `labels` / `positions` [1, T], `cu_seqlens` (int32, the
    padding sequences last when there is padding), `samples` (how many sequences are samples), the
    samples themselves and the logical rows they fill (`rows`)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    samples: int
    sequences: list[list[int]]
    rows: torch.Tensor

    @property
    def lengths(self) -> list[int]:
        return [len(s) for s in self.sequences]

    def thd_params(self) -> Any:
        """The ordinary packing's params (each sequence causal on its own)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        longest = int(self.cu_seqlens.diff().max())
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                               max_seqlen_q=longest, max_seqlen_kv=longest)

    def plan(self, **kwargs: Any) -> Any:
        from megatron_rl_patches.shared_prefix import plan_shared_prefix

        return plan_shared_prefix(self.tokens, self.cu_seqlens, samples=self.samples, **kwargs)


def grpo_batch(groups: tuple = ((40, (5, 9, 3)),), alone: tuple = (12,), padding: int = 4, vocab: int = 64,
               seed: int = 0, context: int = 0) -> PackedBatch:
    """`groups`: (prompt length, response lengths) per group, each group's prompt after one shared
    `context` of that many tokens (a privileged context before every prompt); `alone`: lengths of
    samples sharing nothing; `padding`: rows after the samples (their own sequence)."""
    gen = torch.Generator().manual_seed(seed)

    def draw(n: int, low: int = 0) -> list[int]:
        return torch.randint(low, vocab, (n,), generator=gen).tolist()

    shared_context = draw(context)
    sequences = []
    for prompt_length, responses in groups:
        prompt = shared_context + draw(prompt_length)
        sequences += [prompt + draw(n) for n in responses]
    sequences += [draw(n) for n in alone]
    return _packed(sequences, padding, draw)


def packed_batch(sequences: list[list[int]], padding: int = 0, vocab: int = 64, seed: int = 0,
                 pad_id: int | None = None) -> PackedBatch:
    """`sequences` packed as one micro-batch, `padding` rows after them (random ids from `seed`, or
    `pad_id` repeated as slime pads)."""
    gen = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(0, vocab, (n,), generator=gen).tolist()  # noqa: E731
    if pad_id is None:
        return _packed(sequences, padding, draw)
    drawn = iter([[pad_id] * padding, draw(1)])  # the padding, then the last label
    return _packed(sequences, padding, lambda n: next(drawn))


def step_batches(sequences: list[list[int]], cuts: list[list[int]], padding: int = 3, seed: int = 0,
                 multiple: int = 1, pad_id: int | None = None) -> list[PackedBatch]:
    """One step's micro-batches: `cuts[i]` the indices of `sequences` packed in micro-batch i (each with
    `padding` rows after its samples, and as many more as make it a `multiple` of rows; `pad_id`: their id)."""
    batches = []
    for index, cut in enumerate(cuts):
        rows = sum(len(sequences[i]) for i in cut) + padding
        batches.append(packed_batch([sequences[i] for i in cut], padding + (-rows) % multiple, seed=seed + index,
                                    pad_id=pad_id))
    return batches


def _packed(sequences: list[list[int]], padding: int, draw: Any) -> PackedBatch:
    flat = [t for s in sequences for t in s]
    lengths = [len(s) for s in sequences] + ([padding] if padding else [])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    stream = torch.tensor(flat + draw(padding) + draw(1))
    positions = torch.cat([torch.arange(n) for n in lengths])
    return PackedBatch(tokens=stream[None, :-1].contiguous(), labels=stream[None, 1:].contiguous(),
                       positions=positions[None], cu_seqlens=cu, samples=len(sequences), sequences=sequences,
                       rows=torch.arange(len(flat)))


def tree_batch(system: int = 24, turns: tuple = ((6, 8, 2), (5, 7, 3)), per_turn: bool = False,
               alone: tuple = (), padding: int = 4, vocab: int = 64, seed: int = 0) -> PackedBatch:
    """Multi-turn trajectories that branch: a `system` prompt, then per turn (user tokens, assistant
    tokens, branches): each trajectory so far gets one user message, then `branches` assistant
    replies of its own (a tree: turn k shared by every branch below it). `per_turn`: one sample per
    trajectory and turn (each sample the prefix of the next turn's), else the final trajectories;
    `alone`: lengths of samples sharing nothing; `padding`: rows after the samples."""
    gen = torch.Generator().manual_seed(seed)

    def draw(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    trajectories = [draw(system)]
    sequences = []
    for user, assistant, branches in turns:
        grown = []
        for trajectory in trajectories:
            asked = trajectory + draw(user)
            grown += [asked + draw(assistant) for _ in range(branches)]
        trajectories = grown
        if per_turn:
            sequences += trajectories
    sequences = (sequences if per_turn else trajectories) + [draw(n) for n in alone]
    return _packed(sequences, padding, draw)


def packed_ids(samples: list[list[int]], padding: int = 0) -> tuple[torch.Tensor, list[int]]:
    """`samples` packed one after another, then `padding` zeros: (ids [T], cu_seqlens of the samples)."""
    tokens = torch.tensor([t for s in samples for t in s] + [0] * padding)
    cu = [0]
    for s in samples:
        cu.append(cu[-1] + len(s))
    return tokens, cu


def trie_size(sequences: list[list[int]]) -> int:
    """The samples' distinct leading-token sequences: what a tree plan computes (naively counted)."""
    return len({tuple(sample[:k + 1]) for sample in sequences for k in range(len(sample))})


def ordinary(model: Any, batch: PackedBatch, **kwargs: Any) -> Any:
    """The model's ordinary packed forward of `batch`."""
    return model(batch.tokens, batch.positions, None, packed_seq_params=batch.thd_params(), **kwargs)


def planned(model: Any, batch: PackedBatch, route: str = "auto", pad_to: int = 1, repeated_padding_once: bool = False,
            **kwargs: Any) -> Any:
    """The model's forward of `batch` under its shared-prefix plan (the model prepared first;
    `repeated_padding_once` as `plan_shared_prefix` takes it)."""
    from megatron_rl_patches.shared_prefix import prepare_shared_prefix, shared_prefix_params

    prepare_shared_prefix(model)
    params = shared_prefix_params(batch.plan(pad_to=pad_to, repeated_padding_once=repeated_padding_once), route=route)
    return model(batch.tokens, None, None, packed_seq_params=params, **kwargs)


def scores(logits: torch.Tensor, batch: PackedBatch, tp_group: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropy) of the sample rows from [1, T, V] logits (`tp_group`: V split over it)."""
    from megatron_rl_patches import log_probs_and_entropy

    rows = logits[0, batch.rows]
    return log_probs_and_entropy(rows, batch.labels[0, batch.rows], tp_group=tp_group, with_entropy=True)


def objective(log_probs: torch.Tensor, entropy: torch.Tensor, seed: int = 5) -> torch.Tensor:
    """A weighted sum of both, with weights of both signs (every row's gradient differs)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.randn(2, log_probs.numel(), generator=gen)
    return (weights[0] * log_probs).sum() + (weights[1] * entropy).sum()


class TokenCount:
    """The ids each forward's embedding was handed (a pre-hook on the model's embedding)."""

    def __init__(self, model: Any):
        self.seen: list[int] = []
        self.handle = model.embedding.register_forward_pre_hook(self._note, with_kwargs=True)

    def _note(self, module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        self.seen.append(int(ids.numel()))

    def close(self) -> None:
        self.handle.remove()
