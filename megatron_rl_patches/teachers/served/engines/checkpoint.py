"""A pooling server's checkpoint compared with the teacher head's (`check_served_checkpoint`), at
connect: vLLM's `/v1/models` card names the path the server was started with (`root`). Where that
path is a checkpoint directory on this machine too (one node, a shared file system), its config.json
and its output layer's fixed rows are fingerprinted as the head's are (`head_fingerprint`), and a
server of another checkpoint is refused naming both directories — two checkpoints of one
architecture send states of the same width, which the reply's checks cannot tell apart. A `root`
that is a hub name or a path of the server's machine only cannot be compared (docs/distillation.md)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_rl_patches.teachers.errors import ServedTeacherRefusal


def check_served_checkpoint(root: Any, head_source: str, head_fingerprint: str, url: str) -> None:
    """ServedTeacherRefusal when the served checkpoint `root` and the head's directory are both
    readable here and differ (config.json, or the output layer's first, middle and last rows)."""
    if not isinstance(root, str) or not head_source or not (Path(root) / "config.json").is_file():
        return
    if Path(root).resolve() == Path(head_source).resolve():
        return
    served, head = fingerprint_of(root), head_fingerprint or fingerprint_of(head_source)
    if served and head and served != head:
        raise ServedTeacherRefusal(f"{url} serves the checkpoint {root!r} (its /v1/models root), whose config.json or "
                                   f"output layer differs from the head's directory {head_source!r} (fingerprints "
                                   f"{served} and {head}): the states would be projected through another model's "
                                   "head; give the head the served checkpoint's directory", url)


def fingerprint_of(directory: str) -> str:
    """The checkpoint fingerprint of `directory` ('' where it is no checkpoint the head reader takes:
    then nothing is compared)."""
    from megatron_rl_patches.teachers.head.teacher_head import HeadPlan  # lazy: import cost (torch, safetensors)

    try:
        return HeadPlan.of(directory, None, None, 1, 0).fingerprint
    except (ValueError, OSError):
        return ""
