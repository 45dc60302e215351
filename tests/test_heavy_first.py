"""The lanes' heaviest-first order (tests/kit/heavy_first.py, called by tests/conftest.py): every
listed module exists (a rename would silently drop it to the collection's order), none twice, and the
reorder puts them first in their order while every other module keeps its collected order."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from kit.heavy_first import HEAVIEST_FIRST, heavy_first

REPO = Path(__file__).resolve().parents[1]


def test_every_listed_module_exists_once():
    assert [p for p in HEAVIEST_FIRST if not (REPO / p).is_file()] == []
    assert len(set(HEAVIEST_FIRST)) == len(HEAVIEST_FIRST)


def test_listed_modules_come_first_in_order_and_the_rest_keep_theirs():
    light = ["tests/a_test.py::one", "tests/z_test.py::two", "tests/a_test.py::three"]
    heavy = [f"{HEAVIEST_FIRST[1]}::x", f"{HEAVIEST_FIRST[0]}::y", f"{HEAVIEST_FIRST[1]}::z"]
    items = [SimpleNamespace(nodeid=n) for n in [light[0], heavy[0], light[1], heavy[1], heavy[2], light[2]]]
    heavy_first(items)
    assert [i.nodeid for i in items] == [heavy[1], heavy[0], heavy[2], *light]


def test_the_lanes_keep_the_order():
    assert "--no-loadscope-reorder" in (REPO / "Makefile").read_text()
