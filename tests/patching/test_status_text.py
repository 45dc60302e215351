"""apply() / applied() / revert() print one line per patch (its name, how many targets are in
each status, each reason once) and stay lists of PatchStatus for programs."""
from __future__ import annotations

import json

import megatron_rl_patches
from megatron_rl_patches.patching.records import (
    APPLIED,
    NOT_SELECTED,
    PENDING,
    SKIPPED,
    VERSION,
    WAITING,
    PatchStatus,
    PatchStatuses,
)


def test_apply_prints_one_line_per_patch_and_stays_a_list_of_statuses(clean_patch_state):
    statuses = megatron_rl_patches.apply(only="ddp_hooks,train_reentry")
    names = list(dict.fromkeys(s.name for s in statuses))
    assert names == ["ddp_hooks", "train_reentry"] and len(statuses) > len(names)
    for text in (str(statuses), repr(statuses)):
        assert "PatchStatus(" not in text
        assert [line.split()[0] for line in text.splitlines()] == names
    assert all(isinstance(s, PatchStatus) for s in statuses) and statuses == list(statuses)
    json.dumps([s.as_dict() for s in statuses])
    everything = megatron_rl_patches.applied()
    assert len(str(everything).splitlines()) == len({s.name for s in everything})
    assert isinstance(megatron_rl_patches.revert(), PatchStatuses)


def test_counts_per_status_and_each_reason_once():
    module = "megatron.training.training"
    statuses = PatchStatuses([
        PatchStatus("train_reentry", f"{module}:train", PENDING, f"waiting for the import of {module}", WAITING),
        PatchStatus("train_reentry", f"{module}:enable_forward_pre_hook", PENDING,
                    f"waiting for the import of {module}", WAITING),
        PatchStatus("train_reentry", "slime.model:train", APPLIED),
        PatchStatus("ddp_hooks", "m:A.f", SKIPPED, "megatron-core 0.9 is outside '>=0.13'", VERSION),
        PatchStatus("ddp_hooks", "m:A.g", SKIPPED, "megatron-core 0.9 is outside '>=0.13'", VERSION),
        PatchStatus("grad_windows", "s:f", SKIPPED, "not selected", NOT_SELECTED),
    ])
    assert str(statuses).splitlines() == [
        f"train_reentry  pending 2/3, applied 1/3 targets (pending: waiting for the import of {module})",
        "ddp_hooks      skipped 2/2 targets (megatron-core 0.9 is outside '>=0.13')",
        "grad_windows   off 1/1 target (not selected)",  # not selected is no problem: its own word
    ]
    assert str(PatchStatuses()) == "no patch"
