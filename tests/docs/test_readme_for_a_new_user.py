"""README.md as a new user reads it: a first page of at most 200 lines (what the package is, how to
switch it on per framework, near the top, one line each, linking the index's table and the
recipes, the two commands, a quickstart, a group's prompt once, where to read on); the teacher
entries as their own table (docs/variables.md, beside every variable), each entry one that the
variables' parsers take (verl's where the table says so); the stated `make test` time adds up
(docs/testing.md); no history words in the docs ("behaves exactly as before": a reader has no
"before")."""
from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from doc_blocks import REPO  # noqa: E402

README = (REPO / "README.md").read_text(encoding="utf-8")
VARIABLES = (REPO / "docs" / "variables.md").read_text(encoding="utf-8")  # README's tables, moved (issue 122)
TESTING = (REPO / "docs" / "testing.md").read_text(encoding="utf-8")
FIRST_PAGE = ["Switch it on", "The two commands", "Quickstart", "A group's prompt once: shared-prefix packing",
              "Install", "Compatibility", "Where to read on"]
FRAMEWORKS = ("slime", "verl", "NeMo-RL", "Megatron-LM")
# what a page says of the package's own past: the reader meets the package as it is
HISTORY = ("exactly as before", "was built for", "used to ", "always did")
NOT_READER_PAGES = ("design.md", "testing.md", "benchmarks.md")  # the maintainers' pages


def section(text: str, heading: str) -> str:
    return text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]


def test_the_readme_is_a_first_page_of_at_most_200_lines():
    """Issue 122 item 4: 342 lines, CI timings and a served-teacher walkthrough in the middle; each
    moved part keeps its page (docs/testing.md, docs/distillation.md, docs/variables.md,
    docs/patching.md) and the README links it."""
    assert len(README.splitlines()) <= 200, len(README.splitlines())
    assert re.findall(r"^## (.+)$", README, flags=re.M) == FIRST_PAGE
    for page in ("docs/testing.md#what-make-demo-and-make-test-build-and-how-long-they-take", "docs/variables.md",
                 "docs/distillation.md#two-replicas-on-one-cpu-machine-one-stopped-mid-run",
                 "docs/patching.md#the-patches", "docs/recipes.md#a-groups-prompt-once-shared-prefix-packing",
                 "docs/shared-prefix.md", "examples/shared_prefix_multi_turn.py"):
        assert f"]({page})" in README, page
    blocks = re.findall(r"(?m)^```(\w*)$", README)[::2]  # the opening fences
    assert blocks == ["bash", "python", "text", "python", "python", "text"], blocks


def test_the_readme_switches_each_framework_on_in_one_line_near_the_top():
    headings = re.findall(r"^## (.+)$", README, flags=re.M)
    assert headings[0] == "Switch it on", headings
    part = section(README, "## Switch it on")
    assert "](docs/index.md#which-patches-your-loop-uses)" in part
    items = [line for line in part.splitlines() if line.startswith("- ")]
    assert [re.match(r"- \*\*([\w-]+)", item).group(1) for item in items] == list(FRAMEWORKS)
    for item in items:
        assert "MEGATRON_RL_PATCHES=all" in item and re.search(r"\]\(docs/recipes\.md#[\w-]+\)", item), item


def entry_rows() -> list[tuple[list[str], str]]:
    """(the entries of its first cell, what its last cell says of verl) per row of the entry table."""
    table = VARIABLES.split("| teacher entry |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    rows = []
    for line in table:
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        rows.append(([e.replace("\\|", "|") for e in re.findall(r"`([^`]+)`", cells[0])], cells[-1]))
    return rows


def test_the_teacher_entries_are_their_own_table_each_entry_one_the_parsers_take():
    from megatron_rl_patches.integrations.verl.entry import parse_entry, verl_teacher
    from megatron_rl_patches.settings import VERL_TEACHER
    from megatron_rl_patches.teachers.kinds import parse_entries, student

    rows = entry_rows()
    assert len(rows) >= 8 and all(entries for entries, _ in rows)
    for entries, verl in rows:
        for entry in entries:
            assert len(parse_entries(entry)) == 1, entry  # slime's variable takes every entry of the table
            takes = verl == "yes" or (verl == "yes (served)" and entry.startswith("http"))
            if student.recognizes(entry):
                with pytest.MonkeyPatch.context() as patch:
                    patch.setenv(VERL_TEACHER, entry)
                    assert verl_teacher(types.SimpleNamespace()).self_teacher is not None
            elif takes:
                parse_entry(entry)
            else:
                with pytest.raises(ValueError):
                    parse_entry(entry)
    opd_row = next(line for line in VARIABLES.splitlines() if line.startswith("| `MEGATRON_RL_PATCHES_OPD_TEACHERS`"))
    assert "the table below" in opd_row and ";head=" not in opd_row  # the grammar is no longer one cell


def test_the_make_test_time_adds_up_from_its_lanes():
    """One sentence holds the figures (easy to update): the total is their sum."""
    said = re.search(r"its lanes took (\d+):(\d\d) on an idle machine \(([^)]*)\)", " ".join(TESTING.split()))
    assert said, "docs/testing.md states make test's lane time"
    lanes = re.findall(r"(\w+) (\d+):(\d\d)", said.group(3))
    assert [name for name, _, _ in lanes] == ["main", "oldest", "newest", "served", "verl"]
    total = sum(int(m) * 60 + int(s) for _, m, s in lanes)
    assert total == int(said.group(1)) * 60 + int(said.group(2)), (total, said.group(0))


@pytest.mark.parametrize("page", [REPO / "README.md", *[p for p in sorted((REPO / "docs").glob("*.md"))
                                                        if p.name not in NOT_READER_PAGES]],
                         ids=lambda p: p.name)
def test_no_page_speaks_of_the_packages_past(page):
    text = " ".join(page.read_text(encoding="utf-8").split())
    assert [phrase for phrase in HISTORY if phrase in text] == []


@pytest.mark.parametrize("page", ["README.md", *sorted(p.name for p in (REPO / "docs").glob("*.md"))])
def test_no_page_leans_on_a_file_outside_the_repository(page):
    """Issue 105 item 9: docs/benchmarks.md sent the reader to "CONTEXT.md §21", a notes file no clone
    holds; the pages stand on their own."""
    text = (REPO / page if page == "README.md" else REPO / "docs" / page).read_text(encoding="utf-8")
    assert not re.search(r"CONTEXT\.md|DESIGN\.md|§\s?\d", text), page


def test_the_readmes_backend_row_names_every_backend_the_variable_takes():
    """Issue 105 item 9: the row named torch and triton, not gemm."""
    from megatron_rl_patches.ops.kernels import backend_names

    (row,) = [line for line in VARIABLES.splitlines() if line.startswith("| `MEGATRON_RL_PATCHES_BACKEND` |")]
    named = set(re.findall(r"`(\w+)`", row.split("|")[2]))
    assert set(backend_names()) <= named, (row, backend_names())
