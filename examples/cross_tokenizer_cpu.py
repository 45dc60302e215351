"""On-policy distillation from a teacher with another tokenizer, in a hand-written loop on CPU
(docs/distillation.md, "Teachers with another tokenizer"): a byte-level BPE student samples
responses, the SentencePiece-style teacher (byte fallback, another vocabulary) scores its own
encoding of the same bytes, and the student learns from the chunk-aligned signal.

    .venv/bin/python examples/cross_tokenizer_cpu.py [--steps 6]

Models are bigram stand-ins (an embedding of the previous token, then the output layer) so the
loop stays small; the cross-tokenizer calls are the ones a real loop makes.
"""
from __future__ import annotations

import argparse
import json
import textwrap

import torch

from megatron_rl_patches import cross_tokenizer as ct
from megatron_rl_patches.ops.lm_head import lm_head_log_probs_and_entropy

CORPUS = ["the teacher reads the same bytes", "机器学习 learns from data 🚀", "def f(x):\n    return x + 1",
          "a chunk spans the same bytes on both sides"] * 8
HIDDEN = 16
RESPONSE = 12  # student tokens sampled per response
BATCH = 8
K = 4
LR = 0.5


def tokenizers_pair():
    """(student, teacher): a byte-level BPE and a SentencePiece-style BPE with byte fallback."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    student = Tokenizer(models.BPE())
    student.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    student.decoder = decoders.ByteLevel()
    student.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace()
    base.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"],
                                                         show_progress=False))
    vocab = base.get_vocab()
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(base.to_str())["model"]["merges"]]
    teacher = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    teacher.pre_tokenizer = pre_tokenizers.Metaspace()
    teacher.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
    return student, teacher


class Bigram(torch.nn.Module):
    """hidden_i = tanh(embedding of token i−1) (a start row for i = 0); `weight` the output layer."""

    def __init__(self, vocab: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Parameter(torch.randn(vocab + 1, HIDDEN, generator=g))
        self.weight = torch.nn.Parameter(torch.randn(vocab, HIDDEN, generator=g) * 2)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        previous = torch.cat([ids.new_full((1,), self.weight.size(0)), ids[:-1]])
        return torch.tanh(self.embed[previous])

    @torch.no_grad()
    def sample(self, n: int, gen: torch.Generator) -> torch.Tensor:
        ids = torch.empty(0, dtype=torch.long)
        for _ in range(n):
            row = torch.tanh(self.embed[ids[-1] if ids.numel() else self.weight.size(0)])
            probs = torch.softmax(self.weight @ row, -1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)])
        return ids


def distill_step(student, teacher, tokenizers, optimizer, gen) -> tuple[float, float]:
    """One step on BATCH sampled responses: (mean per-token reverse-KL estimate, mean chunk-start divergence)."""
    s_tok, t_tok = tokenizers
    shared = ct.shared_strings(s_tok, t_tok)
    optimizer.zero_grad()
    token_term, start_term, n_tokens = 0.0, 0.0, 0
    for _ in range(BATCH):
        ids = student.sample(RESPONSE, gen)
        t_ids, alignment = ct.retokenize(ids, s_tok, t_tok)  # the teacher's own encoding, chunks
        hidden = student.hidden(ids)
        s_lp, _ = lm_head_log_probs_and_entropy(hidden, student.weight, ids)
        with torch.no_grad():
            t_hidden = teacher.hidden(t_ids)
            t_lp, _ = lm_head_log_probs_and_entropy(t_hidden, teacher.weight, t_ids)
        kl = ct.chunk_reverse_kl(s_lp, t_lp, alignment)  # exact chunk sums; excluded tokens give 0
        starts = ct.chunk_start_topk_divergence(hidden, student.weight, t_hidden, teacher.weight, alignment,
                                                shared, k=K, divergence="forward_kl")
        ((kl.sum() + starts.sum()) / (BATCH * RESPONSE)).backward()
        token_term += kl.sum().item()
        start_term += starts.sum().item()
        n_tokens += ids.numel()
    optimizer.step()
    return token_term / n_tokens, start_term / n_tokens


def main(steps: int = 6, seed: int = 0) -> list[tuple[float, float]]:
    tokenizers = tokenizers_pair()
    student = Bigram(tokenizers[0].get_vocab_size(), seed)
    teacher = Bigram(tokenizers[1].get_vocab_size(), seed + 1).requires_grad_(False)
    optimizer = torch.optim.SGD(student.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(seed)
    return [distill_step(student, teacher, tokenizers, optimizer, gen) for _ in range(steps)]


# the table's columns and what each means (printed above the table)
COLUMNS = (
    ("step", f"the optimizer step: each samples {BATCH} responses of {RESPONSE} tokens from the student "
             "as it is at that step, then takes one SGD step on the two terms below"),
    ("reverse KL / token", "the sampled estimate of KL(student || teacher) on those responses: over each chunk "
                           "(a run of bytes both tokenizations split at the same places), the student's "
                           "log-probability of the chunk minus the teacher's, summed, divided by the student "
                           "tokens (ct.chunk_reverse_kl); one batch's estimate is noisy and may even be negative"),
    ("chunk-start KL / token", f"at the first token of each chunk, KL(teacher || student) over up to {K + 1} "
                               f"buckets: the byte strings of the teacher's {K} likeliest next tokens that the "
                               "student's vocabulary also has, and one bucket for everything else "
                               "(ct.chunk_start_topk_divergence), summed, divided by the student tokens"),
)


def report(records: list[tuple[float, float]]) -> str:
    """The table of `main`'s records, with what its columns mean above it and how to read it below."""
    lines = ["Distilling a byte-level BPE student from a teacher with another tokenizer",
             "(SentencePiece-style, byte fallback). Columns:"]
    lines += [textwrap.fill(f"{name}: {meaning}", 96, initial_indent="  ", subsequent_indent="      ")
              for name, meaning in COLUMNS]
    lines += ["", "  ".join(f"{name:>{width}}" for (name, _), width in zip(COLUMNS, (4, 18, 22)))]
    lines += [f"{step:>4}  {kl:>18.4f}  {starts:>22.4f}" for step, (kl, starts) in enumerate(records)]
    lines += ["", textwrap.fill("Both columns fall as the student moves towards the teacher. With so few samples "
                                "per step the rows jump about: compare the first steps with the last (more with "
                                "--steps 10), not one row with the next.", 96)]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    print(report(main(args.steps)))
