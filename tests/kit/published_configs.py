"""The config.json of published checkpoints (tests/apps/cli/hf_configs/NAME.json, each as its model
card ships it: a wrapper's text model nested) as checkpoint directories, the one thing every entry
point takes (a directory holding config.json alone will do where no weights are read)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

CONFIGS = Path(__file__).resolve().parents[1] / "apps" / "cli" / "hf_configs"
NAMES = tuple(sorted(path.stem for path in CONFIGS.glob("*.json")))


def published_config(name: str) -> dict[str, Any]:
    """The published config.json of `name` as a dict."""
    return json.loads((CONFIGS / f"{name}.json").read_text())


def published_checkpoint(name: str, root: Path) -> Path:
    """`root`/`name`/config.json, the published config of `name` (made once per `root`)."""
    directory = Path(root) / name
    if not (directory / "config.json").is_file():
        directory.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(CONFIGS / f"{name}.json", directory / "config.json")
    return directory
