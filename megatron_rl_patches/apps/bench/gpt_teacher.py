"""A GPTModel as an in-process teacher of the public teacher step (`teachers.TeacherStep`), for the
privileged-context benchmarks: `response_logits` runs one right-padded forward over a
`TeacherBatch` (causal attention: padding after a sequence cannot reach its rows) and returns each
sample's logits on its response rows; `GptTeacher` turns them into `BatchScores` (its own top-k,
the exact tail, the actual token's log-prob, float64), with a privileged context key or none."""
# lazy imports: import cost: torch loads when a benchmark runs (in its case workers mostly)
from __future__ import annotations

from typing import Any


def response_logits(model: Any, batch: Any, vocab_size: int) -> list[Any]:
    """Per sample the model's logits [R_i, vocab_size] of the rows that predict its response."""
    import torch

    longest = max(len(sequence) for sequence in batch.sequences)
    tokens = torch.zeros(len(batch), longest, dtype=torch.long)
    for i, sequence in enumerate(batch.sequences):
        tokens[i, :len(sequence)] = sequence
    positions = torch.arange(longest)[None].expand(len(batch), longest)
    logits = model(tokens, positions, None)
    return [logits[i, start - 1:len(sequence) - 1, :vocab_size]
            for i, (sequence, start) in enumerate(zip(batch.sequences, batch.response_starts))]


def scores_of(logits: list[Any], batch: Any, top_k: int) -> Any:
    """`BatchScores` from each sample's response-row logits: top-k, exact tail, token log-prob."""
    import torch

    from megatron_rl_patches.teachers import BatchScores

    tokens, ids, values, tails = [], [], [], []
    for i, rows in enumerate(logits):
        log_probs = torch.log_softmax(rows.double(), dim=-1)
        best, chosen = log_probs.topk(top_k, dim=-1)
        response = batch.sequences[i][batch.response_starts[i]:]
        tokens.append(log_probs.gather(1, response[:, None].long())[:, 0])
        ids.append(chosen)
        values.append(best)
        tails.append(torch.logsumexp(log_probs.scatter(1, chosen, float("-inf")), dim=-1))
    return BatchScores(tokens, ids, values, tails)


class GptTeacher:
    """A frozen GPTModel scoring whole samples (a `BatchTeacher`); `context`: its privileged key."""

    def __init__(self, model: Any, vocab_size: int, top_k: int, context: str | None = None) -> None:
        self.model, self.vocab_size, self.top_k, self.context = model, vocab_size, top_k, context

    def score(self, batch: Any) -> Any:
        import torch

        with torch.no_grad():
            return scores_of(response_logits(self.model, batch, self.vocab_size), batch, self.top_k)
