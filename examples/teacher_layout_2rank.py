"""A teacher at its own layout, on 2 CPU ranks: a tiny Hugging Face Qwen3 teacher built at
TeacherLayout(tp=2) (its weights split over both ranks) beside a student at TP=1 x DP=2 (each rank
its own rows, of another count than the other's). `score_at_layout` gives each rank the log-probs
of its own rows; they equal the teacher built whole on that rank (a few fp32 ulps: the row-parallel
halves are summed in another order), and `topk_at_layout` its top-k log-probs and tail.

Run: `.venv/bin/python examples/teacher_layout_2rank.py` (megatron-core >= 0.15: it spawns 2 gloo processes;
about 15 s on 2 cores). docs/layouts.md, "Teacher layout", says what each call does."""
from __future__ import annotations

import tempfile

import torch

VOCAB = 1001  # the tiny checkpoint's vocabulary (tiny_hf_config)
K = 4


def rows(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows (2 on rank 0, 3 on rank 1; 8 tokens each) and their next tokens."""
    ids = torch.randint(0, VOCAB, (2 + rank, 9), generator=torch.Generator().manual_seed(rank))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def whole_teacher_log_probs(chunks, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The reference: the teacher built whole on this rank, its logits, the labels' log-probs."""
    from megatron_rl_patches.ops import log_probs_and_entropy

    count, length = tokens.shape
    positions = torch.arange(length).expand(count, length)
    causal = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        logits = chunks[0](tokens, positions, causal)
        log_probs, _ = log_probs_and_entropy(logits.reshape(count * length, -1), labels.reshape(-1), vocab_size=VOCAB)
    return log_probs.view(count, length)


def on_rank(rank: int, world_size: int, root: str) -> dict:
    """What one rank does: build the teacher at its layout (every rank calls it), score its own rows."""
    from megatron_rl_patches import build_inference_model_from_hf
    from megatron_rl_patches.inference import TeacherLayout, score_at_layout, topk_at_layout
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    tokens, labels = rows(rank)
    ids = torch.stack([torch.randperm(VOCAB, generator=torch.Generator().manual_seed(9))[:K]] * tokens.numel())
    ids = ids.view(*tokens.shape, K)  # the student's top-k ids at each position (here: the same k everywhere)
    with megatron_on_cpu():  # the student's layout: TP=1 x DP=2 (megatron-core's parallel_state)
        layout = TeacherLayout(tp=2)  # the teacher's own: its tensor-parallel group is both ranks
        teacher = build_inference_model_from_hf(root, dtype=torch.float32, layout=layout)
        log_probs = score_at_layout(teacher, tokens, labels)  # [rows, length]: this rank's rows
        topk, tail = topk_at_layout(teacher, tokens, ids)  # [rows, length, K] and [rows, length]
        whole = build_inference_model_from_hf(root, dtype=torch.float32)  # on one rank, for the check
        reference = whole_teacher_log_probs(whole, tokens, labels)
    return {"rank": rank, "rows": tuple(tokens.shape), "topk": tuple(topk.shape), "tail": tuple(tail.shape),
            "largest_error": float((log_probs - reference).abs().max()),
            "weight_rows": teacher[0].embedding.word_embeddings.weight.shape[0]}


def main() -> list[dict]:
    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint
    from megatron_rl_patches.testing.multirank import run_multirank

    with tempfile.TemporaryDirectory() as root:
        write_tiny_checkpoint(root, tiny_hf_config("qwen3"))  # config.json, safetensors, tokenizer
        results = run_multirank(on_rank, 2, root, timeout=300)
    for result in results:
        print(f"rank {result['rank']}: rows {result['rows']}, embedding rows held {result['weight_rows']} "
              f"(half the padded vocabulary), top-k {result['topk']}, tail {result['tail']}; "
              f"largest difference from the whole teacher {result['largest_error']:.1e}")
    return results


if __name__ == "__main__":
    main()
