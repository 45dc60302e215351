"""`megatron-rl-patches demo` at reduced size: both routes run the same loop, the summary's claims
hold (patches and pieces named, logits never allocated on the package route, real-model figures
from the `memory` formula), and an error is called a re-entry crash only when it is one."""
import json
import math
import os
import subprocess
import sys

import pytest

# version-blind: the main lane only (`make demo` runs there); the re-entry crash and the patched route it
# shows are held on every megatron lane by tests/test_reentrant_train.py
pytestmark = [pytest.mark.megatron, pytest.mark.version_blind, pytest.mark.slow]

SMALL = dict(rollouts=2, steps=1)


@pytest.fixture(scope="module")
def summaries():
    from megatron_rl_patches.apps.demo.loop import DemoConfig
    from megatron_rl_patches.apps.demo.session import run_demo

    return {patches: run_demo(DemoConfig(**SMALL), patches=patches) for patches in (True, False)}


def test_package_route_completes_every_rollout_without_logits(summaries):
    from megatron_rl_patches.integrations import default_registry

    summary = summaries[True]
    json.dumps(summary)  # JSON-ready
    assert summary["ok"] and summary["error"] is None and summary["rollouts_completed"] == 2
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["opd_kl"]) for r in summary["rollouts"])
    patches = {p["name"]: p for p in summary["patches_applied"]}
    assert set(patches) == {"ddp_hooks", "gpt_output_processor"}
    assert patches["ddp_hooks"]["status"] == "applied"
    assert patches["gpt_output_processor"]["code"] in ("ok", "native")
    assert all(p["description"] for p in patches.values())
    cfg = summary["config"]
    tokens = cfg["micro_batch_size"] * cfg["seq_length"]
    watch = summary["vocab_wide_tensors"]
    # the largest vocab-wide allocation is a logits tile, never the [T, V] logits
    assert watch["largest_shape"] == [cfg["tile_rows"], cfg["vocab_size"]]
    assert watch["largest_bytes"] < tokens * cfg["vocab_size"] * 4
    teachers = summary["teachers"]
    counted = teachers["trainable_build_bytes_per_teacher"]
    assert teachers["allocated_bytes"] == 0 and counted["grad_buffer"] > 0 and counted["optimizer_state"] > 0
    assert teachers["saved_bytes"] == teachers["count"] * (counted["grad_buffer"] + counted["optimizer_state"])
    # fp32 weights, DP=1, no distributed optimizer: 4 B grad + 8 B Adam per parameter, no padding
    assert teachers["formula_bytes_per_teacher"] == counted["total"] == 12 * teachers["params_per_teacher"]
    streamed = teachers["residency"]  # the teachers' weights live in host memory, streamed per layer
    assert streamed["mode"] == "stream" and streamed["host_bytes"] == streamed["resident_weight_bytes"]
    assert 0 < streamed["peak_device_weight_bytes"] < streamed["resident_weight_bytes"]
    assert all(status.status != "applied" for status in default_registry().applied())  # the demo reverts


def test_plain_route_is_the_same_loop_and_hits_the_reentry_crash(summaries):
    plain, package = summaries[False], summaries[True]
    assert plain["patches_applied"] == [] and plain["package_pieces"] == []
    assert plain["rollouts_completed"] == 1 and not plain["ok"]
    assert plain["error"]["rollout"] == 2 and plain["error"]["reentry_crash"]
    # rollout 1 is the same computation on both routes: logits + torch vs the fused processors
    for key in ("loss", "opd_kl", "entropy", "logprob"):
        assert plain["rollouts"][0][key] == pytest.approx(package["rollouts"][0][key], rel=1e-5, abs=1e-6)
    cfg = plain["config"]
    assert (plain["vocab_wide_tensors"]["largest_bytes"]
            == cfg["micro_batch_size"] * cfg["seq_length"] * cfg["vocab_size"] * 4)
    assert plain["teachers"]["allocated_bytes"] > 0  # trainable builds hold grad buffers


def test_teacher_chosen_ids_give_the_same_rollout_on_both_routes():
    """ids_from="teacher" (the default is "student", see the fixture's runs): the package route
    takes the ids from the first teacher's fused pass; the plain route from its logits. Same numbers."""
    from megatron_rl_patches.apps.demo.loop import DemoConfig
    from megatron_rl_patches.apps.demo.session import run_demo

    cfg = DemoConfig(rollouts=1, steps=1, ids_from="teacher")
    package, plain = (run_demo(cfg, patches=patches) for patches in (True, False))
    assert package["ok"] and plain["ok"]
    for key in ("loss", "opd_kl", "entropy", "logprob"):
        assert plain["rollouts"][0][key] == pytest.approx(package["rollouts"][0][key], rel=1e-5, abs=1e-6)


def test_union_ids_give_the_same_rollout_on_both_routes():
    """ids_from="union": the student's top-k go to the first teacher's pass, which adds its own
    (padding masked); the plain route builds the same union by hand on logits. Same numbers."""
    from megatron_rl_patches.apps.demo.loop import DemoConfig
    from megatron_rl_patches.apps.demo.session import run_demo

    cfg = DemoConfig(rollouts=1, steps=1, ids_from="union")
    package, plain = (run_demo(cfg, patches=patches) for patches in (True, False))
    assert package["ok"] and plain["ok"]
    for key in ("loss", "opd_kl", "entropy", "logprob"):
        assert plain["rollouts"][0][key] == pytest.approx(package["rollouts"][0][key], rel=1e-5, abs=1e-6)
    student = run_demo(DemoConfig(rollouts=1, steps=1, ids_from="student"), patches=True)
    assert package["rollouts"][0]["opd_kl"] > student["rollouts"][0]["opd_kl"]  # more buckets: a finer KL


def test_the_default_ids_are_a_value_slime_opd_accepts():
    """issue 49: the demo's default was "teacher", which MEGATRON_RL_PATCHES_OPD_IDS_FROM refused then."""
    from megatron_rl_patches.apps.demo.loop import DemoConfig
    from megatron_rl_patches.integrations.megatron.opd.opd_settings import IDS_FROM, TEACHERS, opd_settings

    settings = opd_settings({TEACHERS: "/ckpt/t", IDS_FROM: DemoConfig().ids_from})
    assert settings is not None and settings.ids_from == DemoConfig().ids_from == "student"


def test_real_model_rows_use_the_memory_commands_formula(summaries):
    from megatron_rl_patches import training_state_bytes

    real = summaries[True]["real_models"]
    row = next(r for r in real["teachers"] if r["model"] == "8B" and r["dp"] == 8)
    assert row["distributed_optimizer"]
    want = training_state_bytes(8_190_000_000, dp=8, distributed_optimizer=True, param_dtype="bf16", grad_dtype="fp32")
    assert row["per_teacher_bytes"] == want.total and row["saved_bytes"] == 2 * want.total
    logits = next(r for r in real["logits"] if r["model"] == "32B")
    assert logits["actor_logits_bytes"] == logits["tokens"] * 151_936 * 2


def test_real_model_rows_name_families_the_package_serves():
    """issue 49: the 27B row was labelled Gemma-3-27B, a family build_inference_model_from_hf refuses."""
    from megatron_rl_patches.apps.demo.scale import REAL_MODELS

    served = ("qwen3", "qwen2", "llama")  # architecture.py's served families (Qwen3-MoE reads as qwen3)
    assert all(model.vocab_from.lower().replace("-", "").startswith(served) for model in REAL_MODELS), REAL_MODELS


def test_text_summary_names_what_ran_and_what_crashed(summaries):
    from megatron_rl_patches.apps.demo.report import format_summary

    text = format_summary(summaries[True])
    assert "ddp_hooks: applied" in text and "reentrant_train" in text and "never allocated" in text
    assert "8B" in text and "32B" in text and "Gemma" not in text and "re-entry crash" not in text
    plain = format_summary(summaries[False])
    assert "none applied" in plain and "This is the re-entry crash" in plain


def test_both_routes_end_with_what_crashed_and_what_the_package_did(summaries):
    from megatron_rl_patches.apps.demo.report import format_comparison, format_summary

    text = format_comparison(summaries[False], summaries[True])
    assert "without the package: train() crashed on rollout 2 (AssertionError), the re-entry crash" in text
    assert "with it: 2 / 2 rollouts" in text and "(the same computation)" in text
    assert "at real size" not in format_summary(summaries[False], real_models=False)


def test_only_known_reentry_failures_are_called_reentry_crashes():
    from megatron_rl_patches.apps.demo.report import _error
    from megatron_rl_patches.apps.demo.session import describe_error

    def raised(exc):
        try:
            raise exc
        except Exception as caught:  # noqa: BLE001 - a traceback is what describe_error reads
            return caught

    reentry = raised(AssertionError("When overlap_grad_reduce is True, config.no_sync_func must be None"))
    assert describe_error(reentry, 2)["reentry_crash"]
    assert not describe_error(reentry, 1)["reentry_crash"]  # the first call is not a re-entry
    other = describe_error(raised(RuntimeError("CUDA out of memory")), 2)
    assert not other["reentry_crash"]
    text = "\n".join(_error({"error": other, "patches": True}))
    assert "CUDA out of memory" in text and "re-entry" not in text


def test_plain_route_uses_no_piece_of_the_package():
    """In a fresh process: after a --no-patches run no patch, builder, wrapper or loss module of
    the package was ever imported (the demo's own modules and the CPU kit are all it used; the
    memory formulas' positive-int check, `ops.scoring_plan`, imports no op)."""
    script = (
        "import json, sys\n"
        "from megatron_rl_patches.apps.cli import main\n"
        "code = main(['demo', '--rollouts', '2', '--steps', '1', '--json', '--no-patches'])\n"
        "used = sorted(m for m in sys.modules if m.startswith(('megatron_rl_patches.ops', "
        "'megatron_rl_patches.megatron', 'megatron_rl_patches.processors', 'megatron_rl_patches.inference.build', "
        "'megatron_rl_patches.reentrant', "
        "'megatron_rl_patches.integrations', 'megatron_rl_patches.patching.registry'))\n"
        # the sizing formulas' argument check (`positive_int`, torch-free) and the ops' lazy package face
        "            and m not in ('megatron_rl_patches.ops', 'megatron_rl_patches.ops.scoring_plan'))\n"
        "print('USED', json.dumps(used)); sys.exit(code)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MEGATRON_RL_PATCHES": ""})
    assert proc.returncode == 1, proc.stderr[-2000:]
    summary = json.loads(proc.stdout[: proc.stdout.rindex("USED")])
    assert summary["error"]["type"] == "AssertionError" and "no_sync_func must be None" in summary["error"]["message"]
    assert json.loads(proc.stdout.split("USED", 1)[1]) == []
    assert "Traceback" not in proc.stderr


def test_demo_rejects_bad_arguments():
    from megatron_rl_patches.apps.cli import main

    assert main(["demo", "--rollouts", "0"]) == 2
    assert main(["demo", "--no-patches", "--route", "package"]) == 2
