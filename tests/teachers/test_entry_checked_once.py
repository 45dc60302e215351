"""One parser of teacher entries and one construction from an entry (issue 87 item 2): a URL's
user or password is looked for once where the entry comes in (slime's setting, verl's variable,
`build_teachers`), not again on its way to the client; every framework builds its served teacher
through `served.build.served_teacher_of`, nowhere else."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import megatron_rl_patches
from megatron_rl_patches.teachers import redaction
from megatron_rl_patches.teachers.kinds import parse_entries, parse_entry

ROOT = Path(megatron_rl_patches.__file__).resolve().parent
SERVED = "http://a:8000|http://b:8000/;engine=vllm;head=/h@v2;context=hint"


@pytest.fixture
def scans(monkeypatch):
    """How often a text is scanned for a user or password (`redaction.userinfo_spans`, which
    `has_userinfo`, `refuse_userinfo` and `redacted` all call)."""
    seen: list[str] = []
    scan = redaction.userinfo_spans

    def counted(text: str) -> list[tuple[int, int]]:
        seen.append(text)
        return scan(text)

    monkeypatch.setattr(redaction, "userinfo_spans", counted)
    return seen


def test_an_entry_is_scanned_once_where_it_comes_in(scans, monkeypatch):
    """Before: about seven scans (the setting, the entry, the kind, the replica list, each URL)."""
    assert parse_entries(f"{SERVED},/ckpt/x").__len__() == 2 and len(scans) == 1
    scans.clear()
    assert parse_entry(SERVED).path == "http://a:8000|http://b:8000" and len(scans) == 1
    scans.clear()
    from megatron_rl_patches.integrations.verl.entry import parse_entry as verl_entry

    assert verl_entry(SERVED).context == "hint" and len(scans) == 1
    scans.clear()
    from megatron_rl_patches.teachers.build import entries_of

    assert len(entries_of(f"{SERVED},/ckpt/x")) == 2 and len(scans) == 1


def test_the_client_checks_its_own_url_for_direct_users(scans):
    """`ServedTeacher(url)` built by hand is checked by its constructor (the password forms:
    test_password_forms.py)."""
    pytest.importorskip("httpx", reason="the served extra (httpx) is missing")
    from megatron_rl_patches.teachers import ServedTeacher

    with pytest.raises(ValueError, match="carries a user or password"):
        ServedTeacher("http://bob:pw@a:8000")
    assert scans


def test_served_teacher_of_builds_what_the_entry_names():
    pytest.importorskip("httpx", reason="the served extra (httpx) is missing")
    import dataclasses

    from megatron_rl_patches.ops.scoring_plan import ScoringPlan
    from megatron_rl_patches.teachers.served.build import served_teacher_of

    entry = parse_entry("http://a:8000|http://b:8000/;engine=vllm;context=hint")
    teacher = served_teacher_of(entry, ScoringPlan(3))
    assert (teacher.url, teacher.engine_name, teacher.top_k, teacher.context) == \
        ("http://a:8000|http://b:8000", "vllm", 3, "hint")
    assert served_teacher_of(dataclasses.replace(entry, context=None), ScoringPlan(3)).context is None


def test_every_served_teacher_is_built_through_the_one_construction():
    """No module but `teachers/served/build.py` calls `ServedTeacher(...)` (its own module defines it)."""
    callers = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "ServedTeacher":
                callers.append(path.relative_to(ROOT).as_posix())
    assert sorted(set(callers)) == ["teachers/served/build.py"], callers
