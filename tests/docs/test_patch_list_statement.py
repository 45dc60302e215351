"""docs/patching.md's table lists every patch, in the registry's order, and the README sends the
reader there: the registry is the one source of the patch list (issue 29: the README named 6 of 8,
the table 4)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from doc_blocks import REPO  # noqa: E402

from megatron_rl_patches.integrations import default_registry

NAMES = default_registry().patch_names()


def _named(text: str) -> list[str]:
    """The patch names `text` shows in backticks, in order, once each."""
    return list(dict.fromkeys(word for word in re.findall(r"`([a-z_]+)`", text) if word in NAMES))


def test_the_readme_sends_the_reader_to_the_one_list_of_the_patches():
    """The README, a first page (issue 122), names no partial list: it links docs/patching.md's
    table (one row per patch, in order: the test below), where its list of every patch went."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert "](docs/patching.md#the-patches)" in text and "the patches in the order they apply" in text
    assert len(_named(text)) < len(NAMES) // 2  # no copy of the list to fall out of date


def test_the_patching_table_has_one_row_per_patch_in_order():
    text = (REPO / "docs" / "patching.md").read_text(encoding="utf-8")
    table = text.split("## The patches", 1)[1].split("\n\n", 2)[1]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert [re.match(r"\| `([a-z_]+)`", row).group(1) for row in rows] == list(NAMES)


def test_the_compatibility_table_names_every_patch():
    text = (REPO / "docs" / "compatibility.md").read_text(encoding="utf-8")
    table = text.split("## Frameworks whose functions are patched", 1)[1].split("\n\n", 1)[0]
    named = {re.search(r"`([a-z_]+)` \|\s*$", line).group(1) for line in table.splitlines()
             if line.startswith("| ") and re.search(r"`([a-z_]+)` \|\s*$", line)}
    assert named == set(NAMES)


def test_the_compatibility_page_gives_the_extra_range_of_setup_cfg():
    import configparser

    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    pin = next(line.strip() for line in config["options.extras_require"]["megatron"].splitlines() if line.strip())
    assert f"`{pin}`" in (REPO / "docs" / "compatibility.md").read_text(encoding="utf-8")
