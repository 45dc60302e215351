"""Moved module paths: the paths users type (slime's --custom-loss-function-path, the slime
adapter's function, `megatron_rl_patches.megatron.*`) import silently; every other old path
imports the new module itself (the same object) with one DeprecationWarning, the first time."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_rl_patches import _aliases, inference, integrations, megatron

TYPED = {  # path users type -> what it must be
    "megatron_rl_patches.integrations.slime_opd.topk_opd_policy_loss":
        "megatron_rl_patches.integrations.slime.opd.topk_opd_policy_loss",
    "megatron_rl_patches.integrations.slime.calculate_log_probs_and_entropy":
        "megatron_rl_patches.integrations.slime.logprobs.calculate_log_probs_and_entropy",
    "megatron_rl_patches.megatron.processors.log_prob_output_processor":
        "megatron_rl_patches.processors.heads.log_prob_output_processor",
    "megatron_rl_patches.megatron.distill.divergence_output_processor":
        "megatron_rl_patches.processors.distill.divergence_output_processor",
    "megatron_rl_patches.megatron.topk_output_processor": "megatron_rl_patches.processors.heads.topk_output_processor",
}

PROBE = textwrap.dedent(
    """
    import importlib, json, sys, warnings
    paths, typed = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    out = {"same": {}, "warnings": {}, "again": {}, "typed": {}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for old, new in typed.items():  # as slime's load_function resolves a path: module, then attribute
            module, _, name = old.rpartition(".")
            target, _, target_name = new.rpartition(".")
            out["typed"][old] = getattr(importlib.import_module(module), name) is getattr(
                importlib.import_module(target), target_name)
        out["typed_warnings"] = [str(w.message) for w in caught]
        for old, new in paths.items():
            del caught[:]
            module = importlib.import_module(old)
            out["same"][old] = module is importlib.import_module(new)
            out["warnings"][old] = [(w.category.__name__, str(w.message), w.filename) for w in caught]
            del caught[:]
            importlib.import_module(old)
            exec(f"import {old}")
            out["again"][old] = len(caught)
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def probed() -> dict:
    moved = _aliases.moved_paths()
    paths = {old: new for old, (new, _) in moved.items()}
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_RL_PATCHES")}
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(paths), json.dumps(TYPED)], env=environ,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return {"moved": moved, **json.loads(proc.stdout)}


def test_the_old_paths_are_installed():
    assert integrations.__name__ and megatron.__name__ and inference.__name__  # each installs its table on import
    moved = _aliases.moved_paths()
    assert {"megatron_rl_patches.integrations.slime_fused", "megatron_rl_patches.integrations.verl_rows",
            "megatron_rl_patches.integrations.megatron_core", "megatron_rl_patches.megatron.processors",
            "megatron_rl_patches.inference.residency_storage", "megatron_rl_patches.inference.memory",
            "megatron_rl_patches.inference.dist_weights"} <= set(moved)
    silent = {old for old, (_, warns) in moved.items() if not warns}
    assert silent == {"megatron_rl_patches.integrations.slime_opd", "megatron_rl_patches.megatron.processors",
                      "megatron_rl_patches.megatron.distill"}


def test_paths_users_type_resolve_silently(probed):
    assert probed["typed"] == {old: True for old in TYPED}
    assert probed["typed_warnings"] == []


def test_every_old_path_is_the_new_module(probed):
    assert probed["same"] == {old: True for old in probed["moved"]}


def test_old_paths_warn_once_naming_the_new_path_at_the_importer(probed):
    for old, (new, warns) in probed["moved"].items():
        seen = probed["warnings"][old]
        if not warns:
            assert seen == [], old
            continue
        assert [(category, message) for category, message, _ in seen] == [
            ("DeprecationWarning", _aliases.DEPRECATED.format(old=old, new=new))], old
        assert seen[0][2] == "<string>", seen  # attributed to the import statement, not importlib's frames
        assert probed["again"][old] == 0, old


def test_the_processor_modules_import_by_their_earlier_names():
    """`from megatron_rl_patches.megatron import processors` is the log-prob/top-k module, not the package."""
    from megatron_rl_patches.megatron import distill, processors
    from megatron_rl_patches.processors import distill as new_distill
    from megatron_rl_patches.processors import heads

    assert processors is heads and distill is new_distill
    assert megatron.log_prob_output_processor is heads.log_prob_output_processor
    assert megatron.__all__ == ["divergence_output_processor", "hidden_output_processor", "log_prob_output_processor",
                                "topk_output_processor"]


def test_the_suite_treats_the_deprecation_as_an_error():
    """pyproject.toml's filterwarnings: tests must use the new paths."""
    sys.modules.pop("megatron_rl_patches.integrations.verl_topk", None)
    with pytest.raises(DeprecationWarning, match="integrations.verl_topk moved to"):
        import megatron_rl_patches.integrations.verl_topk  # noqa: F401


def test_the_inference_modules_that_became_packages_keep_their_names():
    """`inference.residency` and `inference.layer_major` were modules; as packages they still give
    the names they defined (lazily: the residency modes come without torch)."""
    from megatron_rl_patches.inference import layer_major, residency
    from megatron_rl_patches.inference.layer_major import scoring
    from megatron_rl_patches.inference.residency import placement

    for name in ("on_device", "hold", "hold_if_room", "weights_on_host", "release_streamed", "attach_residency",
                 "residency_of", "check_residency_args", "module_list", "note_activation_bytes", "Residency", "ATTR"):
        assert getattr(residency, name) is getattr(placement, name), name
    from megatron_rl_patches import settings

    assert residency.RESIDENCY_MODES is settings.RESIDENCY_MODES
    assert layer_major.score_layer_major is scoring.score_layer_major
    assert residency.ResidencyBudget is inference.ResidencyBudget


def test_the_teachers_moved_out_of_slime_keep_their_earlier_paths_and_names():
    """issue 73: slime's in-process teacher modules live in `integrations.megatron.opd`; their
    slime paths name the same modules (slime's `host` is `stage_host`, its names kept)."""
    import megatron_rl_patches.integrations.slime  # noqa: F401 - installs its table
    from megatron_rl_patches.integrations.megatron.opd import stage_host

    moved = _aliases.moved_paths()
    home = "megatron_rl_patches.integrations.megatron.opd"
    for name in ("opd_teachers", "teacher_builders", "hf_teachers", "cross_passes", "served_opd", "opd_settings"):
        assert moved[f"megatron_rl_patches.integrations.slime.{name}"] == (f"{home}.{name}", True)
    assert moved["megatron_rl_patches.integrations.slime.host"] == (f"{home}.stage_host", True)
    assert stage_host.SlimeHost is stage_host.StageHost and stage_host.slime_host is stage_host.stage_host
