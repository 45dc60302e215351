"""docs/design.md stays true: its room table lists exactly the rooms of the import-graph test,
which are exactly the package's folders and top-level modules; every path it names exists."""
from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from doc_blocks import REPO  # noqa: E402
from test_import_graph import APPS, ROOMS  # noqa: E402

PAGE = REPO / "docs" / "design.md"
PACKAGE = REPO / "megatron_rl_patches"
NOT_ROOMS = {"__init__", "__main__"}


def _table_rooms() -> list[str]:
    table = PAGE.read_text(encoding="utf-8").split("## Rooms", 1)[1].split("\n## ", 1)[0]
    return [re.match(r"\| `([^`]+)` \|", line).group(1) for line in table.splitlines()
            if re.match(r"\| `([^`]+)` \|", line)]


def _name(entry: str) -> str:
    return entry.rstrip("/").removesuffix(".py")


def test_the_room_table_lists_the_rooms_of_the_import_graph_test_and_the_folders():
    listed = {_name(entry) for entry in _table_rooms()}
    on_disk = {path.stem if path.suffix == ".py" else path.name for path in PACKAGE.iterdir()
               if (path.is_dir() and (path / "__init__.py").exists()) or path.suffix == ".py"} - NOT_ROOMS
    top_level = {room for room in listed if "/" not in room}
    assert top_level == on_disk
    assert top_level - {"apps"} == set(ROOMS) and "apps" in APPS


def missing_paths(text: str) -> list[str]:
    """The backticked paths (`x.py`, `dir/`) of `text` that name nothing: `tests/...`, `docs/...`, `tools/...`
    from the repository, the others below the package (a path may start inside a room: `loading/hf/`)."""
    below = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*") if "__pycache__" not in path.parts}
    missing = []
    for token in sorted(set(re.findall(r"`([A-Za-z0-9_./]+(?:\.py|/))`", text))):
        bare = token.rstrip("/")
        if token.startswith(("tests/", "docs/", "tools/")):
            found = (REPO / token).exists()
        else:
            found = any(path == bare or path.endswith("/" + bare) for path in below)
        if not found:
            missing.append(token)
    return missing


def test_every_path_the_page_names_exists():
    assert missing_paths(PAGE.read_text(encoding="utf-8")) == []


def test_the_path_check_can_fail():
    assert missing_paths("`ops/no_such_module.py`, `residency/`, `tests/nowhere/`, `loading/hf/`") == [
        "ops/no_such_module.py", "tests/nowhere/"]


def test_the_page_reads_in_ten_minutes_and_says_where_shared_prefix_grows():
    """Issue 113: at most 3,500 words (the room table a short paragraph a room; the detail in the
    modules' docstrings), and "Where to add …" names the three ways shared prefix grows."""
    text = PAGE.read_text(encoding="utf-8")
    assert len(text.split()) <= 3500
    where = text.split("## Where to add", 1)[1]
    for entry in ("a new model kind under shared prefix", "a new attention rule under shared prefix",
                  "a new framework's door to shared prefix"):
        assert f"**{entry}**" in where, entry
    longest = max(len(line.split()) for line in text.split("## Rooms", 1)[1].split("\n## ", 1)[0].splitlines())
    assert longest <= 120, longest
