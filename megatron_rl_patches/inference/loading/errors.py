"""The errors weights-only loading raises, the model-fit check that runs before anything is
copied, the guard that turns a failure while copying into a CheckpointReadError, and the JSON
files of a checkpoint read into the same error."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from megatron_rl_patches._log import warn_once
from megatron_rl_patches.inference.loading.json_read import json_file

SHOW = 5  # offending keys / files named in a message; the rest are counted


def shown(items: Sequence[str]) -> str:
    """The first SHOW items, comma separated, then a count of the rest."""
    more = f", ... ({len(items) - SHOW} more)" if len(items) > SHOW else ""
    return ", ".join(items[:SHOW]) + more


class WeightsMismatchError(ValueError):
    """The checkpoint does not fit the model: missing or unexpected keys, or shape mismatches."""

    def __init__(self, source: str, missing: Sequence[str], unexpected: Sequence[str], shapes: Sequence[str]):
        self.missing, self.unexpected, self.shape_mismatches = list(missing), list(unexpected), list(shapes)
        parts = [
            f"{len(items)} {label}: {shown(items)}"
            for label, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatches", shapes))
            if items
        ]
        super().__init__(
            f"checkpoint {source} does not match the model ({'; '.join(parts)}). Check that the model "
            "provider builds the architecture the checkpoint was saved from (layers, hidden size, "
            "vocab padding, tied embeddings); strict=False tolerates missing/unexpected keys, "
            "never shape mismatches"
        )


class CheckpointReadError(ValueError):
    """Checkpoint content that cannot be read (missing or truncated storage files, corrupt
    metadata, values that are not tensors); names the path. `weights_undefined` is True when the
    failure came after part of the model had been overwritten."""

    def __init__(self, path: str | os.PathLike[str], problem: str, *, weights_undefined: bool = False):
        self.path, self.problem, self.weights_undefined = str(path), problem, weights_undefined
        outcome = (
            "the model's weights are now UNDEFINED (part of them were overwritten before the failure): "
            "load a readable checkpoint into it again or rebuild it before using it"
            if weights_undefined
            else "nothing was copied: the model is unchanged"
        )
        super().__init__(f"cannot read checkpoint {self.path!r}: {problem}; {outcome}")

    def __reduce__(self):  # picklable across processes despite the keyword-only argument
        return _rebuild_read_error, (self.path, self.problem, self.weights_undefined)


def _rebuild_read_error(path: str, problem: str, weights_undefined: bool) -> CheckpointReadError:
    return CheckpointReadError(path, problem, weights_undefined=weights_undefined)


def checkpoint_json(file: str | os.PathLike[str]) -> Any:
    """The JSON of one of a checkpoint's files (config.json, an index, tokenizer.json, metadata.json);
    CheckpointReadError naming it where it cannot be read or holds no JSON (malformed, or nested
    past Python's recursion limit)."""
    name = Path(file).name
    return json_file(file, lambda problem: CheckpointReadError(file, f"{name} {problem}; download or save it again"))


def describe(exc: BaseException) -> str:
    """One line for an exception; for torch's CheckpointException (one entry per failed rank)
    the first rank's own exception, not its multi-line report."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (inner, _trace) = next(iter(failures.items()))
        return f"rank {rank}: {describe(inner)}"
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


@contextlib.contextmanager
def copying_into_model(path: str | os.PathLike[str]) -> Iterator[None]:
    """Around the copy into the model's parameters: any failure there leaves them half written."""
    try:
        yield
    except CheckpointReadError:
        raise
    except Exception as exc:
        raise CheckpointReadError(path, f"copying into the model failed ({describe(exc)})",
                                  weights_undefined=True) from exc


def check_fit(path: str | os.PathLike[str], missing: Sequence[str], unexpected: Sequence[str], shapes: Sequence[str],
              strict: bool) -> None:
    """Raise WeightsMismatchError on any shape mismatch, or on missing/unexpected keys when
    `strict`; else warn once about the tolerated keys. Runs before anything is copied."""
    if shapes or (strict and (missing or unexpected)):
        raise WeightsMismatchError(repr(str(path)), missing, unexpected, shapes)
    if not (missing or unexpected):
        return

    warn_once(
        f"non-strict load from {path}: {len(missing)} missing key(s) keep their values "
        f"({', '.join(missing[:SHOW]) or '-'}), {len(unexpected)} unexpected key(s) ignored "
        f"({', '.join(unexpected[:SHOW]) or '-'})"
    )
