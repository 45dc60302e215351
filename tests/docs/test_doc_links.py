"""Every relative link of README.md, CHANGELOG.md and docs/*.md resolves: the file exists and a
`#anchor` names a heading of the page it points at, as GitHub slugs it (lower case, punctuation
dropped, spaces to hyphens, `-1`, `-2` for repeats). Links inside code are not links. And README.md
and docs/ cite no issue of this project by number (a reader has no access to them: the page says
what the package does); an upstream project's issue, `NeMo-RL #3208`, is a citation and stays."""
from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+).*?\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def _prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text: inline markup reduced to its text, lower case, every
    character but letters, digits, spaces, hyphens and underscores dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link or image: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a page has: its headings' slugs (repeats numbered) and explicit <a id/name>."""
    seen: dict[str, int] = {}
    found = set(HTML_ANCHOR.findall(text))
    for line in _prose_lines(text):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(text: str) -> list[str]:
    """The link targets of a page's prose (not those inside code blocks or code spans)."""
    return [target for line in _prose_lines(text) for target in LINK.findall(CODE_SPAN.sub("", line))]


def broken(page: Path) -> list[str]:
    """The relative links of `page` whose file or anchor does not exist, with why."""
    problems = []
    for target in links(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"{target}: no file {file.relative_to(REPO) if file.is_relative_to(REPO) else file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text(encoding="utf-8")):
            problems.append(f"{target}: {file.name} has no heading whose anchor is #{anchor}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page):
    assert broken(page) == []


def test_slugs_are_githubs():
    assert slug("Accumulation windows (`bench windows`)") == "accumulation-windows-bench-windows"
    assert slug("Teachers off the device (residency)") == "teachers-off-the-device-residency"
    assert slug("Top-k OPD step, fused (`bench fused --only opd`)") == "top-k-opd-step-fused-bench-fused---only-opd"
    assert slug("verl 0.9.1: its unfused route") == "verl-091-its-unfused-route"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n## A\n") == {"a", "a-1", "a-2"}


def test_the_check_sees_a_missing_anchor_and_a_missing_file(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n## Its part\n", encoding="utf-8")
    page.write_text("# Page\n[ok](other.md#its-part) [self](#page) [bad](other.md#nope) [gone](none.md)\n"
                    "`[code](other.md#not-checked)`\n```\n[fenced](none.md)\n```\n", encoding="utf-8")
    assert broken(page) == ["other.md#nope: other.md has no heading whose anchor is #nope",
                            f"none.md: no file {tmp_path / 'none.md'}"]


# names before `#N` that make it an upstream project's issue or pull request, not this project's
UPSTREAM = ("NeMo-RL", "NVIDIA-NeMo/RL", "RL", "slime", "verl", "verl-omni", "AReaL", "SkyRL", "ms-swift", "rllm",
            "Megatron-LM", "megatron-core", "Megatron-Bridge", "mbridge", "transformers", "TRL", "torch", "PyTorch",
            "SGLang", "vLLM")
OWN_ISSUE = re.compile(r"\bissues? #?\d+|(?:^|(?<=[\s(]))(?:([\w./-]+)\s+)?#\d+\b", re.I)


def own_issue_citations(text: str) -> list[str]:
    """`issue 46`, `#48`: numbers of this project's issues, outside links' anchors."""
    found = []
    for line in text.splitlines():
        for match in OWN_ISSUE.finditer(re.sub(r"\]\([^)]*\)", "]()", line)):
            if match.group(1) not in UPSTREAM or match.group(0).lower().startswith("issue"):
                found.append(match.group(0))
    return found


@pytest.mark.parametrize("page", [p for p in PAGES if p.name != "CHANGELOG.md"], ids=lambda p: str(p.relative_to(REPO)))
def test_no_page_cites_this_projects_issues(page):
    assert own_issue_citations(page.read_text(encoding="utf-8")) == []


def test_the_citation_check_tells_ours_from_upstream():
    assert own_issue_citations("Qwen3.5 (issue 46), see #48; [x](#top)") == ["issue 46", "see #48"]
    assert own_issue_citations("NeMo-RL #3208 and verl #7688; slime #2032") == []


def test_distillation_links_to_the_recipes_section_it_means():
    """recipes.md is a long page of four frameworks: each link to it from distillation.md names its
    section (a new user followed "A vLLM command line: recipes.md" to the page's top)."""
    text = (REPO / "docs" / "distillation.md").read_text(encoding="utf-8")
    bare = [target for target in links(text) if target.partition("#")[0] == "recipes.md" and "#" not in target]
    assert bare == []
