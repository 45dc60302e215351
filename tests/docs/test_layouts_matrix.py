"""docs/layouts.md, kept true: every cell of the feature x layout matrix is ✅ (with the node ids of
the tests that prove it), `refused` (the error quoted, with the test that shows it), `n.a.` (with
the reason) or ⬜ (untested: their number is recorded here, so it only goes down knowingly). One
`pytest --collect-only` subprocess over every named node id checks that each is collected and that
a ✅ cell's tests carry a `layout(...)` marker naming the cell's layout. Notes marked "(the verl
lane)" name tests collected only where verl is importable: the verl lane (`make test-verl`, which
runs tests/docs too) collects them; elsewhere a static check finds their files, test functions and
layout markers. Notes marked "(the NeMo-RL lane)" name tests of `make test-nemo` (not part of `make
test`): the static check alone."""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from megatron_rl_patches.testing import layouts

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PAGE = REPO / "docs" / "layouts.md"
UNTESTED = 9  # the ⬜ cells of docs/layouts.md today: lower it when a cell gets its test
VALUES = ("✅", "refused", "n.a.", "⬜")
NOTE = re.compile(r"^- (F\d+-L\d+(?:, F\d+-L\d+)*): (.+)$")
CELL_ID = re.compile(r"F\d+-L\d+")
TICKED = re.compile(r"`([^`]+)`")
VERL_LANE = "(the verl lane)"  # a note whose node ids are collected only where verl is importable
NEMO_LANE = "(the NeMo-RL lane)"  # a note whose node ids run in `make test-nemo` only: checked statically
LANES = (VERL_LANE, NEMO_LANE)


def lane_of(note: str) -> str | None:
    """The lane a note's node ids are collected in (None: every lane)."""
    return next((lane for lane in LANES if lane in note), None)


@dataclass
class Matrix:
    layouts: dict[str, tuple[str, str]] = field(default_factory=dict)  # L-id -> (title, marker name)
    features: dict[str, str] = field(default_factory=dict)  # F-id -> title
    cells: dict[str, str] = field(default_factory=dict)  # "F1-L2" -> value
    notes: dict[str, str] = field(default_factory=dict)  # "F1-L2" -> note text
    problems: list[str] = field(default_factory=list)


def _row(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _tables(text: str) -> list[list[list[str]]]:
    tables, current = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            if not re.fullmatch(r"\|[\s:|-]+\|?", line.strip()):
                current.append(_row(line))
        elif current:
            tables.append(current)
            current = []
    if current:
        tables.append(current)
    return tables


def parse(text: str) -> Matrix:
    """The page's layout legend (| L-id | layout | marker | ...), matrix and cell notes."""
    matrix = Matrix()
    for table in _tables(text):
        head = table[0]
        if head[:3] == ["id", "layout", "marker"]:
            for cells in table[1:]:
                matrix.layouts[cells[0]] = (cells[1], cells[2].strip("`"))
        elif head and head[0] == "feature":
            columns = [cell.split()[0] for cell in head[1:]]
            for cells in table[1:]:
                feature = cells[0].split()[0]
                matrix.features[feature] = cells[0]
                if len(cells) != len(head):
                    matrix.problems.append(f"row {feature}: {len(cells) - 1} cells for {len(columns)} layouts")
                for column, value in zip(columns, cells[1:]):
                    matrix.cells[f"{feature}-{column}"] = value
    for line in text.splitlines():
        match = NOTE.match(line)
        if match:
            for cell in CELL_ID.findall(match.group(1)):
                if cell in matrix.notes:
                    matrix.problems.append(f"{cell}: two notes")
                matrix.notes[cell] = match.group(2)
    return matrix


def node_ids(note: str) -> list[str]:
    return [tick for tick in TICKED.findall(note) if "::" in tick]


@pytest.fixture(scope="module")
def matrix() -> Matrix:
    return parse(PAGE.read_text(encoding="utf-8"))


def _collect(ids: set[str], tmp: Path) -> dict[str, list[str]]:
    """{node id: layout names} of the collected ones among `ids`, from one collect-only subprocess."""
    out = tmp / "marks.json"
    env = {**os.environ, "LAYOUT_MARKS_OUT": str(out),
           "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "layout_marks",
                           "-p", "no:cacheprovider", *sorted(ids)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def proofs(matrix: Matrix, lane: str | None) -> set[str]:
    """The node ids named by ✅ and refused cells of notes marked with `lane` (None: no lane's mark;
    "(the verl lane)": their modules collect only where verl is importable)."""
    return {nid for cell, note in matrix.notes.items()
            if matrix.cells.get(cell) in ("✅", "refused") and lane_of(note) == lane
            for nid in node_ids(note)}


@pytest.fixture(scope="module")
def collected(matrix, tmp_path_factory) -> dict[str, list[str]]:
    """{node id: layout names} of every node id the page names outside the verl lane."""
    return _collect(proofs(matrix, None), tmp_path_factory.mktemp("layouts"))


def _cell_problems(matrix: Matrix, collected: dict[str, list[str]], lane: str | None) -> tuple[list[str], list[str]]:
    """(node ids not collected, ✅ proofs without the cell's layout marker) among the notes of one lane."""
    unknown, unmarked = [], []
    for cell, note in sorted(matrix.notes.items()):
        if lane_of(note) != lane:
            continue
        value = matrix.cells[cell]
        marker = matrix.layouts[cell.split("-")[1]][1]
        for nid in node_ids(note):
            if nid not in collected:
                unknown.append(f"{cell}: {nid}")
            elif value == "✅" and marker not in collected[nid]:
                unmarked.append(f"{cell}: {nid} carries layout{tuple(collected[nid])}, not {marker!r}")
    return unknown, unmarked


def test_the_page_has_a_legend_and_a_full_matrix(matrix):
    assert not matrix.problems, matrix.problems
    assert len(matrix.layouts) >= 14 and len(matrix.features) >= 14, (matrix.layouts, matrix.features)
    assert len(matrix.cells) == len(matrix.layouts) * len(matrix.features)
    blank = [cell for cell, value in matrix.cells.items() if value not in VALUES]
    assert not blank, f"cells neither ✅, refused, n.a. nor ⬜: {blank}"


def test_the_pages_layout_table_is_the_table_in_code(matrix):
    """docs/layouts.md's layout table is megatron_rl_patches.testing.layouts.LAYOUTS, row for row, and
    its matrix has one column per layout of the table, in its order."""
    text = PAGE.read_text(encoding="utf-8")
    assert layouts.markdown_table() in text, "write docs/layouts.md's layout table as:\n" + layouts.markdown_table()
    assert matrix.layouts == {layout.id: (layout.title, layout.marker) for layout in layouts.LAYOUTS}
    assert list(dict.fromkeys(cell.split("-")[1] for cell in matrix.cells)) == list(layouts.BY_ID)


def test_a_marker_typo_is_refused():
    """Negative control: a layout marker the table does not know raises, naming the known ones."""
    assert layouts.mark("tp2", "thd").args == ("tp2", "thd")
    with pytest.raises(ValueError, match="tp2"):
        layouts.mark("tp-2")
    with pytest.raises(ValueError):
        layouts.check_names(())


def test_every_decided_cell_has_its_note_and_no_other_cell_has_one(matrix):
    missing = [cell for cell, value in matrix.cells.items() if value != "⬜" and cell not in matrix.notes]
    stray = [cell for cell in matrix.notes if matrix.cells.get(cell, "⬜") == "⬜"]
    assert not missing, f"cells without their note (tests, error or reason): {missing}"
    assert not stray, f"notes of cells that are ⬜ or not in the matrix: {stray}"
    for cell, note in matrix.notes.items():
        value, ids = matrix.cells[cell], node_ids(note)
        if value == "✅":
            assert ids, f"{cell} is ✅ without a test's node id: {note}"
        elif value == "refused":
            quoted = [tick for tick in TICKED.findall(note) if "::" not in tick]
            assert ids and quoted, f"{cell} is refused without the error quoted and its test: {note}"
        else:
            assert len(note.split()) >= 4, f"{cell} is n.a. without a reason: {note}"


def test_every_named_test_is_collected_and_a_proof_carries_its_layout(matrix, collected):
    unknown, unmarked = _cell_problems(matrix, collected, None)
    assert not unknown, "node ids not collected:\n" + "\n".join(unknown)
    assert not unmarked, "proofs without the cell's layout marker:\n" + "\n".join(unmarked)


def _verl_importable() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("verl.models") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.verl
def test_the_verl_lanes_proofs_are_collected_with_their_layouts(matrix, tmp_path):
    """On the verl lane (`make test-verl` runs tests/docs too): the verl-lane node ids collected,
    each ✅ one carrying its cell's layout marker."""
    if not _verl_importable():
        pytest.skip("verl is not installed: the verl lane (`make test-verl`) checks these ids")
    wanted = proofs(matrix, VERL_LANE)
    assert wanted, f"no note says {VERL_LANE!r}"
    unknown, unmarked = _cell_problems(matrix, _collect(wanted, tmp_path), VERL_LANE)
    assert not unknown, "node ids not collected:\n" + "\n".join(unknown)
    assert not unmarked, "proofs without the cell's layout marker:\n" + "\n".join(unmarked)


def static_problems(nid: str, marker: str) -> list[str]:
    """Without importing the module (verl is missing here): the node id's file and test function
    exist, and the module puts a `layout(...)` marker (`layouts.mark`) on its tests and names `marker` in a string."""
    path, _, name = nid.partition("::")
    name, param = name.partition("[")[0], name.partition("[")[2].rstrip("]")
    file = REPO / path
    if not file.is_file():
        return [f"{nid}: no file {path}"]
    tree = ast.parse(file.read_text(encoding="utf-8"))
    problems = []
    if not any(isinstance(node, ast.FunctionDef) and node.name == name for node in tree.body):
        problems.append(f"{nid}: no test function {name} in {path}")
    if not any(isinstance(node, ast.Attribute) and (node.attr == "layout" or (
            node.attr == "mark" and isinstance(node.value, ast.Name) and node.value.id == "layouts"))
            for node in ast.walk(tree)):
        problems.append(f"{nid}: {path} puts no layout(...) marker on its tests")
    strings = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    for wanted in filter(None, (marker, param)):
        if wanted not in strings:
            problems.append(f"{nid}: {path} never names {wanted!r}")
    return problems


def test_the_lanes_proofs_exist_where_their_framework_is_missing(matrix):
    """Everywhere (a static check): every verl-lane and NeMo-RL-lane node id names an existing test
    function in a module that marks layouts and names the cell's layout marker (and the parameter id)."""
    problems = []
    for cell, note in sorted(matrix.notes.items()):
        if lane_of(note) is not None and matrix.cells[cell] in ("✅", "refused"):
            marker = matrix.layouts[cell.split("-")[1]][1] if matrix.cells[cell] == "✅" else ""
            for nid in node_ids(note):
                problems += static_problems(nid, marker)
    assert not problems, "\n".join(problems)


def test_the_untested_count_only_goes_down_knowingly(matrix):
    counts = {value: sum(v == value for v in matrix.cells.values()) for value in VALUES}
    print("docs/layouts.md:", ", ".join(f"{value} {n}" for value, n in counts.items()))
    stated = re.search(r"^Counts: ✅ (\d+), refused (\d+), n\.a\. (\d+), ⬜ (\d+)\.$", PAGE.read_text(encoding="utf-8"),
                       re.MULTILINE)
    assert stated and tuple(map(int, stated.groups())) == tuple(counts.values()), (
        f"the page's Counts line must read: Counts: {', '.join(f'{v} {n}' for v, n in counts.items())}.")
    assert counts["⬜"] == UNTESTED, (
        f"{counts['⬜']} cells are ⬜ untested, UNTESTED records {UNTESTED}: set it to the page's count "
        "(lower when a cell got its test; a cell that lost its proof needs a reason)")


def test_the_parser_sees_a_blank_cell_and_a_proof_without_an_id():
    """Negative control: the checks above fail on a page with a blank cell or a bare ✅."""
    page = ("| id | layout | marker |\n|---|---|---|\n| L1 | TP | `tp2` |\n| L2 | SP | `sp` |\n\n"
            "| feature | L1 TP | L2 SP |\n|---|---|---|\n| F1 thing | ✅ |  |\n\n- F1-L1: no test named\n")
    matrix = parse(page)
    assert matrix.cells == {"F1-L1": "✅", "F1-L2": ""}
    assert [c for c, v in matrix.cells.items() if v not in VALUES] == ["F1-L2"]
    assert node_ids(matrix.notes["F1-L1"]) == []


def test_the_static_check_sees_a_missing_test_and_an_unnamed_layout():
    """Negative control of the verl lane's static check: a test function that is not there, and a
    layout the module never names, are problems; a real verl-lane proof is not."""
    module = "tests/integrations/verl/lane/test_verl_layouts.py::"
    assert static_problems(module + "test_topk_kd_equals_dense_float64[tp2]", "tp2") == []
    assert len(static_problems(module + "test_nobody_wrote[tp2]", "tp2")) == 1
    assert len(static_problems(module + "test_topk_kd_equals_dense_float64[tp2]", "no-such-layout")) == 1
