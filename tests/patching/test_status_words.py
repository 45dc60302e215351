"""One word per state (issue 29: "skipped" meant "not selected", "reverted" and a problem alike):
`PatchStatus.state` names each state; the printed lists of apply()/applied()/revert(), `list` and
`doctor` show that word, so `skipped` and `failed` are only ever problems; the statuses stay the four
public ones; docs/patching.md's table lists exactly these words."""
from __future__ import annotations

import re
from pathlib import Path

import megatron_rl_patches
from megatron_rl_patches.apps.cli.targets import shown_status
from megatron_rl_patches.patching import records
from megatron_rl_patches.patching.records import PatchStatus, PatchStatuses

DOCS = Path(__file__).resolve().parents[2] / "docs" / "patching.md"
CHOICES = {records.NOT_SELECTED: "off", records.DISABLED: "off", records.REVERTED: "reverted",
           records.NATIVE: "native", records.OPTIONAL_MISSING: "n/a"}
PROBLEMS = (records.VERSION, records.MISSING, records.SIGNATURE)


def test_each_skipped_code_has_its_word_and_only_problems_read_skipped():
    for code, word in CHOICES.items():
        assert PatchStatus("p", "m:f", records.SKIPPED, "why", code).state == word
    for code in PROBLEMS:
        assert PatchStatus("p", "m:f", records.SKIPPED, "why", code).state == "skipped"
    assert PatchStatus("p", "m:f", records.FAILED, "boom", records.ERROR).state == "failed"
    assert PatchStatus("p", "m:f", records.PENDING, "wait", records.WAITING).state == "pending"
    assert PatchStatus("p", "m:f", records.APPLIED, "", records.OK).state == "applied"
    assert set(records.STATES) == {"applied", "pending", "off", "reverted", "native", "n/a", "skipped", "failed"}


def test_a_reverted_patch_reads_reverted_and_a_not_selected_one_off(clean_patch_state):
    megatron_rl_patches.apply(only="ddp_hooks")
    statuses = megatron_rl_patches.revert(only="ddp_hooks")
    assert {(s.status, s.code, s.state) for s in statuses} == {(records.SKIPPED, records.REVERTED, "reverted")}
    assert {shown_status(s) for s in statuses} == {"reverted"}
    text = str(megatron_rl_patches.applied())
    assert re.search(r"^ddp_hooks\s+reverted 2/2 targets", text, re.M), text
    assert re.search(r"^grad_windows\s+off \d/\d targets \(not selected\)", text, re.M), text
    assert "skipped" not in text and "failed" not in text


def test_a_problem_still_prints_skipped():
    statuses = PatchStatuses([PatchStatus("ddp_hooks", "m:A.f", records.SKIPPED, "megatron-core 0.9 is outside",
                                          records.VERSION)])
    assert str(statuses) == "ddp_hooks  skipped 1/1 target (megatron-core 0.9 is outside)"


def test_the_docs_table_lists_every_state_word_once():
    text = DOCS.read_text()
    table = text.split("## Statuses", 1)[1].split("\n## ", 1)[0]
    words = re.findall(r"^\| `([^`]+)`", table, re.M)
    assert sorted(words) == sorted(records.STATES), words
