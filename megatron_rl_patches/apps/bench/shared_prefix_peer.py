"""`bench shared-prefix`'s peer row: the same samples through PrefixGrouper (the `prefix_grouper`
package, 0.0.1.post1) on transformers' Qwen3 of the bench's shape, beside its own unshared baseline
(the same transformers model, each sample whole) in the same run; "not installed" where the package
is not importable (`make bench` installs it into .lanes/bench-peer, never into the user's env).

PrefixGrouper takes one prefix per group: here the samples' longest common prefix, cut one token
short of the shortest sample (each sample keeps a suffix of its own); every sample's rest is a
suffix, computed once per sample. A tree's later branch points are therefore computed once per
sample that passes through them. Its attention: the prefix's rows causally, then each suffix's rows
against the prefix's keys and values copied once per suffix (its `batch_repeat_cat`) and its own,
causally. PrefixGrouper ships adapters for flash-attention (CUDA) only; on CPU its two attention
calls go through `padded_causal` here (torch's scaled dot-product attention under the causal rule
of the valid tokens its padding masks leave). Both rows read the hidden states at the rows that
predict a response token, through the model's output layer and a log-softmax on those rows only
(the same head both ways; it keeps those rows' log-probabilities for backward)."""
# lazy imports: import cost: torch and transformers load when the peer runs
from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from typing import Any

from megatron_rl_patches.apps.bench.measure import SavedBytes
from megatron_rl_patches.apps.bench.shared_prefix_rows import timed_row

PEER, PEER_UNSHARED = "PrefixGrouper", "transformers unshared"
PEER_VERSION = "0.0.1.post1"
NOT_INSTALLED = (f"not installed (prefix-grouper=={PEER_VERSION}: `make bench` installs it into .lanes/bench-peer, "
                 "or pip install it where the bench runs)")
ATTENTION_NAME = "megatron_rl_patches_bench_prefix_grouper"  # transformers' attention interface this module adds


def peer_installed() -> bool:
    """Whether `prefix_grouper` is importable."""
    return importlib.util.find_spec("prefix_grouper") is not None


@dataclass(frozen=True)
class Samples:
    """A packed micro-batch read back as samples: each sample's ids and the positions in it whose
    next token is a response token (the rows the loss reads)."""

    ids: tuple[tuple[int, ...], ...]
    scored: tuple[tuple[int, ...], ...]

    @classmethod
    def of_batch(cls, batch: Any) -> Samples:
        tokens, _, cu, rows = batch
        flat, marks, bounds = tokens[0].tolist(), rows[0].tolist(), cu.tolist()
        spans = list(zip(bounds[:-1], bounds[1:]))
        return cls(tuple(tuple(flat[a:b]) for a, b in spans),
                   tuple(tuple(j for j in range(b - a - 1) if marks[a + j]) for a, b in spans))

    def prefix(self) -> int:
        """PrefixGrouper's one prefix: the longest common prefix, each sample keeping >= 1 token of its own."""
        first, shortest = self.ids[0], min(len(s) for s in self.ids)
        common = 0
        while common < shortest - 1 and all(s[common] == first[common] for s in self.ids):
            common += 1
        return common


@dataclass(frozen=True)
class GroupedLayout:
    """The group as PrefixGrouper lays it out: the prefix once, then each sample's suffix; each row's
    own position; the stream row of each scored position of each sample, and its target."""

    ids: Any
    positions: Any
    group_info: list[list[int]]
    rows: Any
    targets: Any


def grouped_layout(samples: Samples) -> GroupedLayout:
    import torch

    prefix = samples.prefix()
    ids, positions, rows, targets = list(samples.ids[0][:prefix]), list(range(prefix)), [], []
    for sample, scored in zip(samples.ids, samples.scored):
        start = len(ids)
        ids += sample[prefix:]
        positions += range(prefix, len(sample))
        rows += [j if j < prefix else start + j - prefix for j in scored]
        targets += [sample[j + 1] for j in scored]
    return GroupedLayout(torch.tensor(ids)[None], torch.tensor(positions)[None],
                         [[prefix, *(len(s) - prefix for s in samples.ids)]], torch.tensor(rows),
                         torch.tensor(targets))


def padded_causal(query: Any, key: Any, value: Any, valid: Any, *, scale: float | None = None) -> Any:
    """PrefixGrouper's attention call on CPU: query [b, h, q, d] (its rows the last q of the keys'),
    key / value [b, g, k, d], `valid` [b, k] the keys that are tokens (not padding); each query row
    sees the valid keys up to its own place among them -> [b, q, h, d]."""
    import torch
    import torch.nn.functional as F

    rows, width = query.size(2), key.size(2)
    if bool(valid.all()):  # no padding: causal, aligned at the last row
        mask = None if rows == width else torch.ones(rows, width, dtype=torch.bool).tril(width - rows)
    else:
        rank = valid.long().cumsum(1) - 1
        mask = valid[:, None, :] & (rank[:, None, :] <= rank[:, -rows:, None])
        mask = (mask | ~valid[:, -rows:, None])[:, None]  # a padding row sees everything (its output unread)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=mask is None and rows > 1,
                                         scale=scale, enable_gqa=query.size(1) != key.size(1))
    return out.transpose(1, 2)


def grouper_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, *,
                      prefix_grouper: Any = None, scaling: float | None = None, **kwargs: Any) -> tuple[Any, None]:
    """transformers' attention interface under ATTENTION_NAME: the call through PrefixGrouper."""
    return prefix_grouper.forward(padded_causal, query, key, value, scale=scaling), None


def qwen3(plan: dict) -> Any:
    """transformers' Qwen3 of the bench's shape (float32, untied output layer, the same initial spread)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM  # lazy: optional dependency transformers

    turns = plan.get("system", 0) + len(plan.get("branches", ())) * (plan.get("user", 0) + plan.get("assistant", 0))
    longest = max([p + r for p, r, _ in plan["cases"]] + [turns])
    config = Qwen3Config(vocab_size=plan["vocab"], hidden_size=plan["hidden"], intermediate_size=3 * plan["hidden"],
                         num_hidden_layers=plan["layers"], num_attention_heads=plan["heads"],
                         num_key_value_heads=plan["groups"], head_dim=plan["hidden"] // plan["heads"],
                         max_position_embeddings=longest, tie_word_embeddings=False, initializer_range=0.02,
                         attention_bias=False, use_cache=False)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).float()
    model.set_attn_implementation("sdpa")
    return model


def scored_log_probs(model: Any, hidden: Any, targets: Any) -> Any:
    log_probs = model.lm_head(hidden).log_softmax(-1)
    return log_probs.gather(-1, targets[:, None])[:, 0]


def unshared_pass(model: Any, samples: Samples) -> Any:
    """Each sample whole, samples of one length in one batch (no padding): the scored log-probs in
    the samples' order."""
    import torch

    by_length: dict[int, list[int]] = {}
    for index, sample in enumerate(samples.ids):
        by_length.setdefault(len(sample), []).append(index)
    parts: dict[int, Any] = {}
    for members in by_length.values():
        ids = torch.tensor([samples.ids[i] for i in members])
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        for row, i in enumerate(members):
            scored = torch.tensor(samples.scored[i], dtype=torch.long)
            parts[i] = scored_log_probs(model, hidden[row, scored],
                                        torch.tensor([samples.ids[i][j + 1] for j in samples.scored[i]]))
    return torch.cat([parts[i] for i in range(len(samples.ids))])


def grouped_pass(model: Any, layout: GroupedLayout, grouper: Any) -> Any:
    hidden = model.model(input_ids=layout.ids, position_ids=layout.positions, prefix_grouper=grouper,
                         use_cache=False).last_hidden_state
    return scored_log_probs(model, hidden[0, layout.rows], layout.targets)


def timed(run: Any, model: Any, train: bool) -> tuple[Any, tuple[float, float], int]:
    """(log-probs, (wall, CPU) seconds, bytes saved for backward) of one pass."""
    import torch

    saved = SavedBytes(ignore=list(model.parameters()))
    started, cpu = time.perf_counter(), time.process_time()
    with torch.set_grad_enabled(train), saved:
        log_probs = run()
    if train:
        (-log_probs.mean()).backward()
        model.zero_grad(set_to_none=True)
    return log_probs.detach(), (time.perf_counter() - started, time.process_time() - cpu), saved.bytes if train else 0


class Peer:
    """The peer's model, built once per bench run (`rows` per case)."""

    def __init__(self, plan: dict) -> None:
        from transformers import AttentionInterface  # lazy: optional dependency transformers

        AttentionInterface.register(ATTENTION_NAME, grouper_attention)
        self.model = qwen3(plan)
        self.rounds = plan["rounds"]

    def rows(self, case: str, batch: Any) -> list[dict]:
        """The peer's unshared row and PrefixGrouper's of one case (ratios to the former, as ours to ours)."""
        from prefix_grouper import PrefixGrouper  # lazy: optional dependency prefix_grouper (the bench lane)

        samples = Samples.of_batch(batch)
        layout = grouped_layout(samples)
        grouper = PrefixGrouper(layout.group_info, device="cpu", padding_mode="right")
        model = self.model
        passes = {PEER_UNSHARED: lambda: unshared_pass(model, samples),
                  PEER: lambda: grouped_pass(model, layout, grouper)}
        attention = {PEER_UNSHARED: "sdpa", PEER: ATTENTION_NAME}
        times: dict[str, dict[str, list[tuple[float, float]]]] = {k: {"forward": [], "train": []} for k in passes}
        saved: dict[str, int] = {}
        values: dict[str, Any] = {}
        for round_index in range(self.rounds + 1):
            for kind, run in passes.items():
                model.set_attn_implementation(attention[kind])
                values[kind], forward, _ = timed(run, model, train=False)
                _, train, saved[kind] = timed(run, model, train=True)
                if round_index:  # the first round warms up
                    times[kind]["forward"].append(forward)
                    times[kind]["train"].append(train)
        model.set_attn_implementation("sdpa")
        tokens = {PEER_UNSHARED: sum(len(s) for s in samples.ids), PEER: int(layout.ids.numel())}
        rows = []
        for kind in passes:
            note = (f"prefix {layout.group_info[0][0]} tokens, once per group" if kind == PEER else
                    "the peer's baseline: transformers' Qwen3, each sample whole")
            rows.append(timed_row(case, kind, tokens[kind], times[kind], times[PEER_UNSHARED], saved[kind],
                                  saved[PEER_UNSHARED], float((values[kind] - values[PEER_UNSHARED]).abs().max()),
                                  note))
        return rows


def peer_rows(peer: Peer | None, case: str, batch: Any) -> list[dict]:
    """The peer's rows of a case, or one row saying it is not installed (`peer` None)."""
    if peer is None:
        return [{"case": case, "packing": PEER, "note": NOT_INSTALLED}]
    return peer.rows(case, batch)


def peer_of(plan: dict) -> Peer | None:
    """The peer for a bench run, None where prefix_grouper is not importable."""
    return Peer(plan) if peer_installed() else None
