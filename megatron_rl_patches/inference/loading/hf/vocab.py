"""The teacher's vocabulary against the student's, checked before the first step: where both
checkpoints carry a tokenizer.json, the same ids (whatever either's padded vocab_size), else the
same vocab_size (config.json).
A teacher with another tokenizer scores other tokens: its log-probs would be silently wrong."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from megatron_rl_patches.inference.loading.errors import checkpoint_json, shown
from megatron_rl_patches.inference.loading.hf.checkpoint_config import TOKENIZER, read_checkpoint_config


def _token_ids(root: Path) -> dict[str, int] | None:
    """token -> id of a tokenizer.json (its model vocab and added tokens), None when absent."""
    file = root / TOKENIZER
    if not file.is_file():
        return None
    data = checkpoint_json(file)
    if not isinstance(data, dict):
        raise ValueError(f"{str(file)!r} is a JSON {type(data).__name__}, not a tokenizer.json object; "
                         "download the tokenizer again")
    model = data.get("model") or {}
    vocab = (model.get("vocab") if isinstance(model, dict) else None) or {}
    try:
        ids = dict(vocab) if isinstance(vocab, dict) else {str(tok[0]): i for i, tok in enumerate(vocab)}  # Unigram
    except (TypeError, IndexError, KeyError) as exc:
        raise ValueError(f"{str(file)!r}: field model.vocab is neither token -> id nor a list of [token, score] "
                         f"({type(exc).__name__}: {exc}); download the tokenizer again") from None
    for number, added in enumerate(data.get("added_tokens") or []):
        if not (isinstance(added, dict) and isinstance(added.get("content"), str)
                and isinstance(added.get("id"), int) and not isinstance(added.get("id"), bool)):
            raise ValueError(f"{str(file)!r}: field added_tokens[{number}] must be an object with a string content "
                             f"and an int id, got {added!r}; download the tokenizer again")
        ids[added["content"]] = added["id"]
    return ids


def _vocab_size(value: Any, argument: str) -> tuple[int, Path | None]:
    if isinstance(value, bool):
        raise TypeError(f"{argument} must be a vocab size (int) or a Hugging Face checkpoint directory, got a bool")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"{argument} must be a positive vocab size, got {value}")
        return value, None
    if isinstance(value, (str, os.PathLike)):
        config = read_checkpoint_config(value, argument)  # a wrapper's text model's vocab_size
        return config.vocab_size, config.root
    raise TypeError(f"{argument} must be a vocab size (int) or a Hugging Face checkpoint directory, "
                    f"got {type(value).__name__}")


def check_teacher_vocab(teacher: str | os.PathLike[str], student: int | str | os.PathLike[str]) -> int:
    """Refuse (ValueError naming both) a teacher checkpoint that does not share the student's
    tokenizer (`student`: its real, unpadded vocab size or its Hugging Face directory). Where both
    directories carry a tokenizer.json, the two must map every token to the same id, whatever
    either config.json's padded vocab_size (Qwen2.5 pads one tokenizer to 151936 or to 152064);
    elsewhere the vocab_size values must be equal. Returns the shared real vocab size (the
    tokenizer's, at most the smaller vocab_size): pass it as the ops' `vocab_size=` so the padding
    rows of either model get no probability mass."""
    teacher_size, teacher_dir = _vocab_size(teacher, "teacher")
    student_size, student_dir = _vocab_size(student, "student")
    teacher_ids = _token_ids(teacher_dir) if teacher_dir is not None else None
    student_ids = _token_ids(student_dir) if student_dir is not None else None
    if teacher_ids is not None and student_ids is not None:
        if teacher_ids == student_ids:
            return min(teacher_size, student_size, max(teacher_ids.values(), default=-1) + 1)
        differ = sorted(t for t in set(teacher_ids) | set(student_ids) if teacher_ids.get(t) != student_ids.get(t))
        shown_diffs = [f"{t!r}: teacher {teacher_ids.get(t)}, student {student_ids.get(t)}" for t in differ]
        raise ValueError(
            f"the tokenizers of teacher {str(teacher)!r} and student {str(student)!r} differ on {len(differ)} "
            f"token(s) ({shown(shown_diffs)}): a teacher must share the student's tokenizer to be scored on the "
            "student's ids; for a teacher with another tokenizer, distill across tokenizers with "
            "megatron_rl_patches.cross_tokenizer (docs/distillation.md, 'Teachers with another tokenizer')"
        )
    if teacher_size != student_size:
        raise ValueError(
            f"teacher {str(teacher)!r} has vocab_size={teacher_size} but the student "
            f"{'at ' + repr(str(student)) + ' ' if student_dir else ''}has vocab_size={student_size}: a teacher "
            "must share the student's tokenizer to be scored on the student's ids; for a teacher with another "
            "tokenizer, distill across tokenizers with megatron_rl_patches.cross_tokenizer (retokenize, "
            "spread_chunk_log_probs, chunk_reverse_kl; docs/distillation.md, 'Teachers with another tokenizer')"
        )
    return teacher_size
