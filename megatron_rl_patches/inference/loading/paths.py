"""Where a checkpoint's weights are: Megatron-LM checkpoint roots, iteration directories, bare
torch_dist directories, state-dict files. Path logic only; imports nothing heavy."""
from __future__ import annotations

import os
import re
from pathlib import Path

from megatron_rl_patches.inference.loading.errors import CheckpointReadError
from megatron_rl_patches.settings import ascii_int

TRACKER = "latest_checkpointed_iteration.txt"
DIST_METADATA = "metadata.json"
_ITER_DIR = re.compile(r"^iter_(\d+)$")


def resolve_checkpoint(load_dir: str | os.PathLike[str], iteration: int | None = None) -> tuple[str, Path, int]:
    """-> (kind, path, iteration), kind "dist" (a torch_dist directory) or "torch" (a state-dict
    file). Accepts a Megatron-LM checkpoint root (latest_checkpointed_iteration.txt; `iteration`
    picks another iter_XXXXXXX), one of its iteration directories, a bare dist checkpoint, or a file."""
    if not isinstance(load_dir, (str, os.PathLike)):
        raise TypeError(f"load_dir must be a path (str or os.PathLike), got {type(load_dir).__name__}")
    root = Path(os.fspath(load_dir)).expanduser()
    if not root.exists():
        raise FileNotFoundError(
            f"load_dir {str(root)!r} does not exist; pass a Megatron checkpoint directory (with "
            f"{TRACKER}), one of its iter_XXXXXXX directories, a torch_dist checkpoint directory or "
            "a torch state-dict file"
        )
    if root.is_file():
        if iteration is not None:
            raise ValueError(
                f"iteration={iteration} needs a checkpoint directory, but load_dir {str(root)!r} is a file"
            )
        return "torch", root, 0
    path, found = root, 0
    if iteration is not None:
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
            raise ValueError(f"iteration must be a non-negative int, got {iteration!r}")
        path, found = root / f"iter_{iteration:07d}", iteration
        if not path.is_dir():
            present = sorted(p.name for p in root.glob("iter_*"))
            raise FileNotFoundError(
                f"iteration {iteration}: {str(path)!r} does not exist; iterations present: {present or 'none'}"
            )
    elif (root / TRACKER).is_file():
        text = _read_tracker(root / TRACKER)
        if text == "release":
            path, found = root / "release", 0
        else:
            path, found = root / f"iter_{int(text):07d}", int(text)
        if not path.is_dir():
            raise FileNotFoundError(f"{TRACKER} in {str(root)!r} names {str(path)!r}, which does not exist")
    elif (match := _ITER_DIR.match(root.name)) is not None:
        found = int(match.group(1))
    if (path / DIST_METADATA).is_file():
        return "dist", path, found
    if any(path.glob("mp_rank_*")):
        raise ValueError(
            f"{str(path)!r} is a legacy per-rank torch checkpoint (mp_rank_*/model_optim_rng.pt), "
            "which holds pickled training state; convert it to torch_dist (Megatron-LM: "
            "--ckpt-convert-format torch_dist) or save the model's state dict to a file"
        )
    raise ValueError(
        f"{str(path)!r} is not a checkpoint megatron-rl-patches can load: no {DIST_METADATA} "
        f"(torch_dist format) and no {TRACKER}"
    )


def _read_tracker(tracker: Path) -> str:
    """The tracker's text: an iteration number or 'release'; CheckpointReadError otherwise."""
    try:
        text = tracker.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointReadError(tracker, f"{TRACKER} is unreadable ({exc})") from exc
    if text != "release" and ascii_int(text) is None:
        raise CheckpointReadError(tracker, f"{TRACKER} holds {text[:80]!r}; expected an iteration number or 'release'")
    return text


def is_foreign_directory(load_dir: str | os.PathLike[str]) -> bool:
    """An existing directory with no trace of a Megatron checkpoint (e.g. a HuggingFace model)."""
    path = Path(os.fspath(load_dir)).expanduser()
    if not path.is_dir() or (path / TRACKER).exists() or (path / DIST_METADATA).exists():
        return False
    return not any(
        _ITER_DIR.match(p.name) or p.name == "release" or p.name.startswith("mp_rank_") for p in path.iterdir()
    )
