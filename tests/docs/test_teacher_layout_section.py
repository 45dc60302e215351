"""docs/layouts.md's "Teacher layout" section, kept true: every row of its served / refused table
names a test that exists (its file and function); a refused row's words are the error's own: the
settings, `TeacherLayout(...)` calls and `memory` commands the row asks for are run here (no world
needed) and must fail with those words, and rows that need a world name a test whose source
asserts them. A served `memory` command is run and must succeed."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from megatron_rl_patches.patching import env

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "layouts.md"
HEADER = ["asked", "served / refused", "the error's words", "test"]


def _section() -> str:
    text = PAGE.read_text()
    start = text.index("## Teacher layout")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _rows() -> list[list[str]]:
    lines = [line for line in _section().splitlines() if line.startswith("|")]
    cells = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]
    assert cells and cells[0] == HEADER, f"the section's table must have the columns {HEADER}"
    return [row for row in cells[2:]]


ROWS = _rows()


def _node(row: list[str]) -> tuple[Path, str]:
    ticked = re.findall(r"`([^`]+)`", row[3])
    assert len(ticked) == 1 and "::" in ticked[0], f"row {row[0]!r}: name one test as `file::function`"
    file, function = ticked[0].split("::")
    return REPO / file, function


def _words(row: list[str]) -> str:
    found = re.findall(r'"([^"]+)"', row[2])
    assert len(found) == 1, f"row {row[0]!r}: quote the error's words once"
    return found[0]


def _run(asked: str, tmp_path: Path) -> tuple[bool, str] | None:
    """(failed, message) of what the row asks for, where it runs without a world; None elsewhere."""
    from megatron_rl_patches.inference.teacher_layout.layout import TeacherLayout
    from megatron_rl_patches.integrations.megatron.opd.opd_settings import TEACHERS, opd_settings

    ticked = re.findall(r"`([^`]+)`", asked)
    first = ticked[0] if ticked else ""
    try:
        if re.fullmatch(r"TeacherLayout\((tp|pp|ep)=\d+\)", first) and "ranks" not in asked:
            name, value = re.fullmatch(r"TeacherLayout\((\w+)=(\d+)\)", first).groups()  # type: ignore[union-attr]
            TeacherLayout(**{name: int(value)})
        elif first.startswith(f"{TEACHERS}=/"):
            opd_settings({TEACHERS: first.partition("=")[2]})
        elif first.startswith(f"{env.INFERENCE_ROLES}="):
            env.checked_role_names({env.INFERENCE_ROLES: first.partition("=")[2]})
        elif first.startswith("memory --hf DIR"):
            from kit.published_configs import published_checkpoint

            from megatron_rl_patches.apps.cli import main

            root = published_checkpoint("Qwen3-8B", tmp_path)
            code = main(first.replace("DIR", str(root)).split())
            return code != 0, ""
        else:
            return None
    except ValueError as exc:
        return True, str(exc)
    return False, ""


def test_the_section_has_its_table():
    assert len(ROWS) >= 20
    assert {row[1] for row in ROWS} == {"served", "refused"}


@pytest.mark.parametrize("row", ROWS, ids=[row[0][:60] for row in ROWS])
def test_each_row_names_a_test_that_exists(row):
    file, function = _node(row)
    assert file.is_file(), f"row {row[0]!r}: {file} does not exist"
    defined = {node.name for node in ast.walk(ast.parse(file.read_text())) if isinstance(node, ast.FunctionDef)}
    assert function in defined, f"row {row[0]!r}: {file.name} defines no {function}"


@pytest.mark.parametrize("row", ROWS, ids=[row[0][:60] for row in ROWS])
def test_each_refusal_fails_with_the_words_the_row_quotes(row, tmp_path, capsys):
    ran = _run(row[0], tmp_path)
    if row[1] == "served":
        assert row[2] == "", f"row {row[0]!r}: a served row quotes no error"
        assert ran is None or not ran[0], f"row {row[0]!r} is served but failed: {ran}"
        return
    words = _words(row)
    if ran is None:  # needs a world: the named test asserts the words
        file, _ = _node(row)
        assert words in file.read_text(), f"row {row[0]!r}: {file.name} does not assert {words!r}"
        return
    failed, message = ran
    message = message or capsys.readouterr().err
    assert failed and words in message, f"row {row[0]!r}: expected an error with {words!r}, got {message!r}"
