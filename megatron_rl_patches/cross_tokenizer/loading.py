"""A tokenizer argument made a `tokenizers.Tokenizer`: the object itself, a tokenizer.json path
or a checkpoint directory holding one; the optional library is imported here only."""
# lazy imports: optional dependency tokenizers
from __future__ import annotations

import os
from typing import Any

EXTRA = "cross-tokenizer"
_KEPT = 8  # tokenizers read from files, kept so a path names one object (and one byte table)
_READ: dict[tuple[str, int], Any] = {}


def tokenizers_library() -> Any:
    """The `tokenizers` module, or an ImportError naming the extra that installs it."""
    try:
        import tokenizers
    except ImportError as error:
        raise ImportError(
            "megatron_rl_patches.cross_tokenizer needs the `tokenizers` library: "
            f"pip install tokenizers, or from a clone of megatron-rl-patches pip install -e '.[{EXTRA}]'") from error
    return tokenizers


def load_tokenizer(tokenizer: Any, name: str = "tokenizer") -> Any:
    """`tokenizer` as a `tokenizers.Tokenizer`: returned as is, read from a tokenizer.json path, or
    from `<directory>/tokenizer.json` (a Hugging Face checkpoint directory)."""
    library = tokenizers_library()
    if isinstance(tokenizer, library.Tokenizer):
        return tokenizer
    if not isinstance(tokenizer, (str, os.PathLike)):
        raise TypeError(f"{name} must be a tokenizers.Tokenizer, a tokenizer.json path or a checkpoint directory, "
                        f"got {type(tokenizer).__name__}; for a transformers tokenizer pass its `.backend_tokenizer`")
    path = os.fspath(tokenizer)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(f"{name}: no tokenizer.json at {path!r}; pass a tokenizer.json file or a checkpoint "
                         "directory holding one (a checkpoint with only a SentencePiece/tiktoken file: convert it "
                         "with transformers and save tokenizer.json)")
    key = (os.path.realpath(path), os.stat(path).st_mtime_ns)
    if key not in _READ:
        if len(_READ) >= _KEPT:
            _READ.pop(next(iter(_READ)))
        try:
            read = library.Tokenizer.from_file(path)
        except Exception as error:  # the library raises a bare Exception for a file it cannot parse
            raise ValueError(f"{name}: {path!r} is not a tokenizer.json the tokenizers library can read ({error}); "
                             "pass the checkpoint's own tokenizer.json (download or save it again: a truncated or "
                             "hand-edited file, or one from a newer tokenizers release, fails here)") from error
        _READ[key] = read
    return _READ[key]
