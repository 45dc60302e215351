"""Whether a served model shares a tokenizer, asked without loading anything: the tokenizer's
spelling of ids spread over its vocabulary, tokenized by the server (its engine's `tokenize`), must
come back as the same ids (an offset or another vocabulary differs)."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches.teachers.errors import TokenizerUnavailable
from megatron_rl_patches.teachers.redaction import scrubbed

TYPE_CHECKING = False
if TYPE_CHECKING:
    from megatron_rl_patches.teachers.served.client import ServedTeacher
    from megatron_rl_patches.teachers.served.http import Deadline

PROBE_IDS = 24
SAME_TOKENIZER = "same_tokenizer"  # the entry option saying the tokenizers are the same
STUDENTS = "the student's tokenizer"


def probe_tokenizer(teacher: ServedTeacher, tokenizer: Any, where: str, whose: str = STUDENTS,
                    deadline: Deadline | None = None) -> None:
    """The served model's tokenizer against `tokenizer` (`whose`: the student's, or the one a served
    teacher of another tokenizer names): its spelling of ids spread over its vocabulary, tokenized
    by the server (the engine's `tokenize`), must give its ids; within `deadline` where given."""
    size = int(tokenizer.get_vocab_size(with_added_tokens=False))
    ids = sorted({round(i * (size - 1) / (PROBE_IDS - 1)) for i in range(PROBE_IDS)})
    text = tokenizer.decode(ids, skip_special_tokens=True)
    want = tokenizer.encode(text, add_special_tokens=False).ids
    model = teacher.served_model(deadline)
    try:
        got = teacher.tokenize(text, deadline)
    except TokenizerUnavailable as none:
        raise ValueError(f"{where}: the served model's tokenizer cannot be checked against {whose}: {none}. Serve it "
                         f"with its tokenizer (without --skip-tokenizer-init), or, if it is {whose}, say so in the "
                         f"entry with ';{SAME_TOKENIZER}' and name the served model's vocabulary size: ';vocab=N' or "
                         f"';config=PATH' (its config.json), checked against the student's tokenizer") from None
    if got != want:
        advice = ("top-k OPD compares the same token ids; serve a teacher of the student's tokenizer, or name "
                  "the served model's tokenizer with ';tokenizer=DIR'") if whose == STUDENTS else \
            "name the served model's own tokenizer (its tokenizer.json)"
        raise ValueError(scrubbed(f"{where}: the served model {model.name!r} does not share {whose} (a probe "
                                  f"text of {len(want)} ids came back from {teacher.url}"
                                  f"{teacher.tokenize_path} as "
                                  f"{'no tokens' if got is None else f'{len(got)} other ids'}): {advice}"))
