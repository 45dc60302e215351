"""The one reader of a Hugging Face checkpoint's config.json for every entry point (the builder,
`check_teacher_vocab`, slime's Hugging Face teachers and `;tokenizer=own` teachers, `doctor`,
`memory --hf`): the checkpoint directory checked (a hub cache folder or the config.json file itself
is refused, naming the directory to pass), config.json read, and a vision-language wrapper's text
model unwrapped (`text_config`: Qwen3.5 as its model card and transformers' save_pretrained write
it), so each reads `vocab_size`, `model_type` and the dtype the same way. JSON only: no torch."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl_patches.inference.loading.errors import checkpoint_json

CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
# the fields a wrapper (a vision-language model) nests its language model's config under
WRAPPER_FIELDS = ("text_config",)
DTYPE_FIELDS = ("dtype", "torch_dtype")  # transformers 5 writes dtype, 4.x torch_dtype; dtype wins (as in AutoConfig)
# the Hugging Face hub cache's folder of one repository (models--ORG--NAME): its revisions under
# snapshots/, the branch heads under refs/, the files under blobs/
SNAPSHOTS, REFS = "snapshots", "refs"


def _main_revision(root: Path) -> str:
    """The revision refs/main names in a hub cache folder ('' without one)."""
    main = root / REFS / "main"
    return main.read_text(encoding="utf-8", errors="replace").strip() if main.is_file() else ""


def hub_cache_snapshots(root: Path) -> list[Path] | None:
    """The snapshot directories of a hub cache folder (`models--ORG--NAME`), the one `refs/main`
    names first; None when `root` is not one."""
    snapshots = root / SNAPSHOTS
    if (root / CONFIG).exists() or not snapshots.is_dir() or not ((root / REFS).is_dir() or (root / "blobs").is_dir()):
        return None
    revision = _main_revision(root)
    return sorted(sorted(p for p in snapshots.iterdir() if p.is_dir()), key=lambda p: p.name != revision)


def hub_cache_problem(root: Path) -> str | None:
    """What to pass instead of the hub cache folder `root`, said after its name (None: not one)."""
    snapshots = hub_cache_snapshots(root)
    if snapshots is None:
        return None
    if not snapshots:
        where = f"its {SNAPSHOTS}/ holds no revision: download the model again"
    else:
        where = f"pass its snapshot directory {str(snapshots[0])!r}"
        others = ", ".join(repr(str(p)) for p in snapshots[1:])
        main = "refs/main's" if snapshots[0].name == _main_revision(root) else "refs/main names none of them"
        if others:
            where += f" ({main}; the others: {others})"
    return f"is a Hugging Face hub cache folder (models--ORG--NAME), not a checkpoint directory; {where}"


def checkpoint_dir(path: Any, argument: str = "path") -> Path:
    """The directory of a Hugging Face checkpoint, checked before anything else looks at it:
    converters treat strings that are not directories as hub ids and go to the network. Every
    entry point takes the directory (the weights and the tokenizer are beside config.json): the
    config.json file itself and a hub cache folder are refused naming the directory to pass."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{argument} must be a path (str or os.PathLike) to a Hugging Face checkpoint directory, "
                        f"got {type(path).__name__}")
    root = Path(os.fspath(path)).expanduser()
    if root.is_file() and root.suffix == ".json":
        raise ValueError(f"{argument} {str(root)!r} is a file; pass the checkpoint directory that holds it as "
                         f"{CONFIG} ({str(root.parent)!r} if it is that): the weights and the tokenizer are read "
                         f"beside it (to plan before downloading, a directory holding {CONFIG} alone will do)")
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is not a directory"
        raise FileNotFoundError(
            f"{argument} {str(root)!r} {what}; pass a local Hugging Face checkpoint directory ({CONFIG} and "
            "*.safetensors; download it first, e.g. `hf download ORG/NAME --local-dir DIR`)"
        )
    cache = hub_cache_problem(root)
    if cache is not None:
        raise ValueError(f"{argument} {str(root)!r} {cache}")
    if not (root / CONFIG).is_file():
        raise FileNotFoundError(
            f"{argument} {str(root)!r} has no {CONFIG}; pass the directory that holds the checkpoint's "
            f"{CONFIG} and *.safetensors files"
        )
    return root


def _read_fields(path: Any, argument: str = "path") -> dict[str, Any]:
    """config.json of the checkpoint directory `path` as written (wrappers still nested)."""
    file = checkpoint_dir(path, argument) / CONFIG
    data = checkpoint_json(file)
    if not isinstance(data, dict):
        raise ValueError(f"{str(file)!r} holds a JSON {type(data).__name__}, expected an object")
    return data


def named_dtype(fields: dict[str, Any]) -> Any:
    """The dtype one level of config.json names (`dtype` before `torch_dtype`); None where it names none."""
    return next((fields[name] for name in DTYPE_FIELDS if fields.get(name)), None)


def text_config(config: dict[str, Any], source: str = CONFIG) -> dict[str, Any]:
    """The language model's fields: a wrapper's `text_config` (its tie_word_embeddings the wrapper's,
    and its dtype where the wrapper writes one: transformers loads the whole model in it), else
    config.json itself."""
    for field in WRAPPER_FIELDS:
        text = config.get(field)
        if text is None:
            continue
        if not isinstance(text, dict):
            raise ValueError(f"{source}: {CONFIG}'s {field} must be an object, got {type(text).__name__}")
        merged = {**text, "tie_word_embeddings": config.get("tie_word_embeddings",
                                                            text.get("tie_word_embeddings", False))}
        outer = named_dtype(config)  # the wrapper's, under either name, beats either of the text model's
        if outer is not None:
            merged = {name: value for name, value in merged.items() if name not in DTYPE_FIELDS}
            merged["dtype"] = outer
        return merged
    return config


@dataclass(frozen=True)
class CheckpointConfig:
    """A checkpoint directory's config.json: `fields` as written, `text` its language model's
    (a wrapper unwrapped), `model_type` the checkpoint's own (a wrapper's names its family)."""

    root: Path
    fields: dict[str, Any]
    text: dict[str, Any]
    argument: str = "path"

    @property
    def source(self) -> str:
        return str(self.root)

    @property
    def model_type(self) -> Any:
        return self.fields.get("model_type")

    @property
    def vocab_size(self) -> int:
        """The text model's vocab_size, a ValueError naming the argument and the field otherwise."""
        size = self.text.get("vocab_size")
        where = f"{self.argument} {self.source!r}: {CONFIG}"
        if isinstance(size, bool) or not isinstance(size, int):
            nested = " (nor its text_config)" if self.text is not self.fields else ""
            raise ValueError(f"{where} has no integer vocab_size{nested}; is it a complete Hugging Face config?")
        if size < 1:
            raise ValueError(f"{where}'s vocab_size must be positive, got {size}")
        return size

    @property
    def dtype(self) -> Any:
        """The checkpoint's dtype as config.json names it (None where it names none)."""
        return named_dtype(self.text)


def read_checkpoint_config(path: Any, argument: str = "path") -> CheckpointConfig:
    """The config of the Hugging Face checkpoint directory `path` (TypeError / FileNotFoundError /
    ValueError naming `argument` and what to pass)."""
    root = checkpoint_dir(path, argument)
    fields = _read_fields(root, argument)
    return CheckpointConfig(root, fields, text_config(fields, str(root)), argument)
