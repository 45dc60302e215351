"""The served Hugging Face families the docs list are the registry's: every list between the
`hf-families` markers is what tools/doc_families.py writes from it, and no page lists three or more
families by hand outside the markers (such a list goes stale when a family is added)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("doc_families", REPO / "tools" / "doc_families.py")
assert _spec is not None and _spec.loader is not None
doc_families = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(doc_families)


def hand_lists(text: str) -> list[str]:
    """Runs of three or more backticked served model_types outside the markers."""
    names = "|".join(re.escape(name) for name in doc_families.served())
    one = rf"`(?:{names})`"
    run = re.compile(rf"{one}(?:\s*(?:,|/|\band\b|\bor\b)\s*(?:and\s+|or\s+)?{one}){{2,}}")
    return [m.group(0) for m in run.finditer(doc_families.BLOCK.sub("", text))]


def test_every_marked_list_is_the_registrys():
    assert doc_families.stale(doc_families.pages()) == [], "run: python tools/doc_families.py"


def test_no_page_lists_families_by_hand():
    found = {str(page.relative_to(REPO)): hand_lists(page.read_text(encoding="utf-8"))
             for page in doc_families.pages()}
    assert {page: runs for page, runs in found.items() if runs} == {}, \
        f"put such a list between {doc_families.START} and {doc_families.END} and run tools/doc_families.py"


def test_the_pages_that_name_the_served_families_carry_the_list():
    for page, count in (("docs/index.md", 1), ("docs/recipes.md", 2)):
        assert (REPO / page).read_text(encoding="utf-8").count(doc_families.START) >= count, page


def test_the_tool_rewrites_a_stale_list_and_check_fails_on_it(tmp_path, monkeypatch):
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    page.write_text(f"Families: {doc_families.START}`llama`, `qwen2`{doc_families.END}; more.\n", encoding="utf-8")
    monkeypatch.setattr(doc_families, "REPO", tmp_path)
    monkeypatch.setattr(doc_families, "pages", lambda root=tmp_path: [page])
    assert doc_families.main(["--check"]) == 1
    assert doc_families.main([]) == 0
    assert page.read_text(encoding="utf-8") == \
        f"Families: {doc_families.START}{doc_families.family_list()}{doc_families.END}; more.\n"
    assert doc_families.main(["--check"]) == 0
    assert "`qwen3_5`" in doc_families.family_list() and "`kimi_k2`" in doc_families.family_list()
    assert hand_lists("`llama`, `qwen2`, `qwen3` and `qwen3_moe`") == ["`llama`, `qwen2`, `qwen3` and `qwen3_moe`"]
    assert hand_lists("`llama` and `qwen2`") == []
