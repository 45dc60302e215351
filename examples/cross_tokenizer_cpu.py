"""On-policy distillation from a teacher with another tokenizer, in a hand-written loop on CPU
(docs/distillation.md, "Teachers with another tokenizer"): a byte-level BPE student samples
responses, the SentencePiece-style teacher (byte fallback, another vocabulary) scores its own
encoding of the same bytes, and the student learns from the chunk-aligned signal.

    python examples/cross_tokenizer_cpu.py [--steps 6]

Models are bigram stand-ins (an embedding of the previous token, then the output layer) so the
loop stays small; the cross-tokenizer calls are the ones a real loop makes.
"""
from __future__ import annotations

import argparse
import json

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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    print(f"{'step':>4}  {'reverse KL / token':>18}  {'chunk-start KL / token':>22}")
    for step, (kl, starts) in enumerate(main(args.steps)):
        print(f"{step:>4}  {kl:>18.4f}  {starts:>22.4f}")
