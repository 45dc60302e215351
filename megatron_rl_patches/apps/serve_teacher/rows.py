"""Prompt log-probs from final hidden states (`prompt_log_prob_entries`), as vLLM's `/v1/completions`
writes them: the state at position p through the model's output layer in float32, log-softmax over
the vocabulary, the top-k (ranks 1..k) and the actual next token with its rank (the count of ids at
least as likely, itself included, as vLLM counts) beside them when outside. Rows are taken a chunk at
a time so no [T, V] tensor is held for a long sample."""
from __future__ import annotations

from typing import Any

import torch

CHUNK_ROWS = 256


def prompt_log_prob_entries(states: torch.Tensor, weight: torch.Tensor, next_ids: list[int],
                            k: int) -> list[dict[str, dict[str, Any]]]:
    """One entry per row of `states` [n, H] (row r predicts `next_ids[r]`) through `weight` [V, H]:
    {str(id): {"logprob", "rank", "decoded_token"}} holding the top-`k` and the actual id."""
    if states.shape[0] != len(next_ids):
        raise ValueError(f"prompt_log_prob_entries: {states.shape[0]} states for {len(next_ids)} next ids")
    entries: list[dict[str, dict[str, Any]]] = []
    head = weight.to(torch.float32)
    for first in range(0, len(next_ids), CHUNK_ROWS):
        chunk = states[first: first + CHUNK_ROWS].to(torch.float32)
        actual = torch.tensor(next_ids[first: first + CHUNK_ROWS], dtype=torch.int64)
        log_probs = torch.log_softmax(chunk @ head.T, dim=-1)
        values, ids = torch.topk(log_probs, k, dim=-1) if k else (log_probs[:, :0], actual[:, None][:, :0])
        token = log_probs.gather(1, actual[:, None])
        ranks = (log_probs >= token).sum(dim=-1)
        for row, (top_ids, top_values) in enumerate(zip(ids.tolist(), values.tolist(), strict=True)):
            entry = {str(actual[row].item()): {"logprob": float(token[row, 0]), "rank": int(ranks[row]),
                                               "decoded_token": None}}
            for rank, (one, value) in enumerate(zip(top_ids, top_values, strict=True), start=1):
                entry.setdefault(str(one), {"logprob": value, "rank": rank, "decoded_token": None})
            entries.append(entry)
    return entries
