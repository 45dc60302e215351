"""A privileged context for a teacher of another tokenizer (`cross_with_context`): its own encoding
of each sample (`cross_tokenizer.TeacherSample`) with the prompt replaced by a context of the
teacher's ids. The response's teacher tokens and their alignment with the student's rows stay as
they are (the response's bytes are the same), so the chunk-start buckets and the token-level signal
are read on `context_i + response_i` exactly as on the sample itself."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_rl_patches.cross_tokenizer.teacher_passes import TeacherSample
from megatron_rl_patches.teachers.context.teacher_context import with_context
from megatron_rl_patches.teachers.head.cross_buckets import cross_batch


def cross_with_context(samples: Sequence[TeacherSample], contexts: Sequence[torch.Tensor], *,
                       vocab_size: int | None = None, max_length: int | None = None) -> list[TeacherSample]:
    """Per sample `contexts[i]` (the teacher's ids) then the teacher's encoding of its response, the
    response length and alignment unchanged: score `cross_batch(...)` of the result as of the
    samples themselves. `vocab_size`: the teacher's vocabulary (ids at or past it refused);
    `max_length`: its length budget per sample; every check of `with_context`, naming the sample."""
    if isinstance(samples, (str, bytes)) or not isinstance(samples, Sequence) or \
            not all(isinstance(s, TeacherSample) for s in samples):
        raise TypeError("cross_with_context(samples=...) takes the teacher's TeacherSamples (cross_tokenizer's "
                        f"sample of each student sample), got {type(samples).__name__}")
    privileged = with_context(cross_batch(samples), contexts, vocab_size=vocab_size, max_length=max_length)
    return [TeacherSample(tokens.to(sample.tokens.device), sample.response_length, sample.alignment)
            for tokens, sample in zip(privileged.sequences, samples)]
