"""What a served teacher raises: a failure to score (`ServedTeacherError`: nothing answered, the
deadline passed, the server failed) or a refusal (`ServedTeacherRefusal`, also a ValueError: the
request cannot be served as asked). Both name the URL and, where one is at fault, the sample.
Every message is `scrubbed` as it is built: a server may quote the API key in any reply, a 200's
fields too, and the client quotes those fields."""
from __future__ import annotations

from megatron_rl_patches.teachers.redaction import scrubbed


class ServedTeacherError(RuntimeError):
    """A served teacher could not score a step; `url` and `sample` (None: not one sample's fault)."""

    def __init__(self, message: str, url: str = "", sample: int | None = None) -> None:
        super().__init__(scrubbed(message))  # the one place the client's messages pass: no piece of a live key
        self.url = url
        self.sample = sample


class ServedTeacherStopped(ServedTeacherError):
    """A request stopped before it was sent (its sample answered by another replica, or its step
    failed or the teacher closed): where the sample was answered elsewhere it says nothing of the
    replica it was queued for, which is not taken out for it."""


class ServedTeacherRefusal(ServedTeacherError, ValueError):
    """A request the teacher refuses (or the server refused with a 4xx): fix the argument named."""


class TokenizerUnavailable(ServedTeacherRefusal):
    """The server has no tokenizer to ask (vLLM started with `--skip-tokenizer-init`)."""
