"""`memory --hf PATH --teacher-tp N [--teacher-pp M]` (issue 58 item 2): a teacher at its own
tensor / pipeline-parallel layout over the student's --tp x --pp x --dp ranks, per-GPU bytes and
host bytes per rank beside the same teacher at the student's layout; what a layout does not serve
refused by name."""
from __future__ import annotations

import json

import pytest

from megatron_rl_patches.inference.loading.hf.memory_plan import hf_memory_plan


def _resident(report: dict) -> tuple[dict, dict]:
    """The report's resident rows: (the teacher at its own layout, the teacher at the student's)."""
    rows = [row for row in report["layouts"] if row["residency"] == "resident"]
    assert [row["layout"].startswith("own") for row in rows] == [True, False]
    return rows[0], rows[1]


def test_a_teacher_at_tp8_beside_a_dp8_student_holds_an_eighth_per_gpu_and_nothing_on_the_host(cli_run, published):
    root = str(published("Qwen3-8B"))
    code, out, _ = cli_run("memory", "--hf", root, "--teacher-tp", "8", "--dp", "8", "--json")
    assert code == 0
    report = json.loads(out)
    assert (report["world"], report["teacher_tp"], report["teacher_dp"]) == (8, 8, 1)
    own = _resident(report)[0]
    student = [row for row in report["layouts"] if row["layout"] == "student's"]
    assert own["gpu_bytes"] == hf_memory_plan(root, tp=8).mode("resident").device_peak
    assert own["host_bytes_per_rank"] == 0 and own["residency"] == "resident"
    whole = hf_memory_plan(root, tp=1)
    assert {row["residency"]: (row["gpu_bytes"], row["host_bytes_per_rank"]) for row in student} == {
        mode: (whole.mode(mode).device_peak, whole.mode(mode).host) for mode in ("resident", "swap", "stream")}
    # an eighth of the whole, but for the norms every rank holds whole and the vocab's padding
    assert abs(own["gpu_bytes"] * 8 / student[0]["gpu_bytes"] - 1) < 0.002
    code, out, _ = cli_run("memory", "--hf", root, "--teacher-tp", "2", "--tp", "2", "--dp", "4")
    assert code == 0 and "own (TP=2 x DP=4)" in out and "host per rank" in out


@pytest.mark.parametrize("mode", ["swap", "stream"])
def test_swap_and_stream_at_a_teacher_layout_plan_its_own_shard_in_host_memory(cli_run, published, mode):
    """--teacher-tp 8 --dp 8 --residency MODE: the own layout's swap / stream rows hold the rank's own
    shard (an eighth) in host memory, its device bytes those of the plan at tp=8 (stream: a layer and
    the embedding or output layer, prefetch 2 here), the chosen mode marked; beside the student's rows."""
    root = str(published("Qwen3-8B"))
    code, out, err = cli_run("memory", "--hf", root, "--teacher-tp", "8", "--dp", "8", "--residency", mode,
                             "--prefetch", "2", "--json")
    assert code == 0, err
    report = json.loads(out)
    rows = {(row["layout"].startswith("own"), row["residency"]): row for row in report["layouts"]}
    plan, whole = hf_memory_plan(root, tp=8, prefetch=2), hf_memory_plan(root, tp=1, prefetch=2)
    own, theirs = rows[True, mode], rows[False, mode]
    assert (own["gpu_bytes"], own["host_bytes_per_rank"]) == (plan.mode(mode).device_peak, plan.mode(mode).host)
    assert own["host_bytes_per_rank"] == rows[True, "resident"]["gpu_bytes"]  # the rank's resident shard
    assert abs(own["host_bytes_per_rank"] * 8 / theirs["host_bytes_per_rank"] - 1) < 0.002  # an eighth
    assert theirs["host_bytes_per_rank"] == whole.mode(mode).host
    assert report["residency"] == mode and [row["chosen"] for row in report["layouts"]].count(True) == 2
    code, out, _ = cli_run("memory", "--hf", root, "--teacher-tp", "8", "--dp", "8", "--residency", mode)
    assert code == 0 and f"* {mode}" in out and "swap / stream keep that shard in host memory" in out


def test_a_teacher_at_tp2_x_pp4_beside_a_dp8_student_holds_an_eighth_of_the_layers_per_gpu(cli_run, published):
    root = str(published("Qwen3-8B"))
    code, out, _ = cli_run("memory", "--hf", root, "--teacher-tp", "2", "--teacher-pp", "4", "--dp", "8", "--json")
    assert code == 0
    report = json.loads(out)
    assert (report["world"], report["teacher_tp"], report["teacher_pp"], report["teacher_dp"]) == (8, 2, 4, 1)
    own, whole_row = _resident(report)
    plan, whole = hf_memory_plan(root, tp=2, pp=4), hf_memory_plan(root, tp=1)
    assert (own["tp"], own["pp"]) == (2, 4) and own["gpu_bytes"] == plan.mode("resident").device_peak
    # each stage holds 1/4 of the layers at half their width: 1/8 of the layers' bytes per GPU; the
    # stage holding the most adds half the embedding (or output layer) to its layers
    assert plan.layers_per_stage * 4 == whole.layers_per_stage == 36
    assert plan.stage_params[1] * 8 == pytest.approx(whole.layer_params * whole.layers_per_stage, rel=0.002)
    assert own["gpu_bytes"] < whole_row["gpu_bytes"] / 6 and own["host_bytes_per_rank"] == 0
    code, out, _ = cli_run("memory", "--hf", root, "--teacher-pp", "2", "--dp", "4")
    assert code == 0 and "own (TP=1 x PP=2 x DP=2)" in out


@pytest.mark.parametrize(("argv", "words"), [
    (("--teacher-tp", "3", "--dp", "8"), "--teacher-tp 3 cannot be laid over the student's 8 rank(s)"),
    (("--teacher-tp", "2", "--teacher-pp", "3", "--dp", "8"), "--teacher-tp 2 x --teacher-pp 3 cannot be laid over "
                                                              "the student's 8 rank(s)"),
    (("--teacher-tp", "2", "--teacher-ep", "2"), "--teacher-ep 2: a teacher's own expert-parallel size is not served"),
    (("--teacher-ep", "2",), "--teacher-ep 2: a teacher's own expert-parallel size is not served"),
])
def test_what_a_layout_does_not_serve_is_refused_by_name(cli_run, published, argv, words):
    code, out, err = cli_run("memory", "--hf", str(published("Qwen3-8B")), *argv)
    assert code != 0 and words in err and out == ""


@pytest.mark.parametrize(("name", "tp"), [("Qwen3.5-27B", 4), ("Qwen3-Next-80B-A3B", 2), ("Mixtral-8x7B-v0.1", 8),
                                          ("DeepSeek-V3", 8)])
def test_linear_attention_expert_and_multi_latent_families_are_planned_at_their_own_layout(cli_run, published, name,
                                                                                             tp):
    """Gated-delta-net linear attention, mixtures of experts (experts split over the teacher's
    tensor-parallel group) and multi-latent attention: planned as the builder builds them."""
    root = str(published(name))
    code, out, err = cli_run("memory", "--hf", root, "--teacher-tp", str(tp), "--dp", "8", "--json")
    assert code == 0, err
    own, whole = _resident(json.loads(out))
    assert own["gpu_bytes"] == hf_memory_plan(root, tp=tp).mode("resident").device_peak
    assert 1 / tp < own["gpu_bytes"] / whole["gpu_bytes"] < 1.01 / tp  # the norms and routers whole on every rank


def test_a_tp_beyond_the_key_value_heads_repeats_them_qwen3_5_27b_at_tp8(cli_run, published, tmp_path):
    """Issue 58's headline: Qwen3.5-27B (24 query heads, 4 key/value heads) at --teacher-tp 8 beside
    a TP=1 x DP=8 student, each key/value head repeated on 2 ranks (kv_heads.py): 6.30 GiB per GPU,
    what a rank of the same model with its heads copied to 8 holds (the build's fill is that model's),
    16 full-attention layers x one key/value head of 256 x 5120 (k and v) more than an eighth."""
    root = str(published("Qwen3.5-27B"))
    code, out, err = cli_run("memory", "--hf", root, "--teacher-tp", "8", "--dp", "8", "--json")
    assert code == 0, err
    own, whole = _resident(json.loads(out))
    plan = hf_memory_plan(root, tp=8)
    assert own["gpu_bytes"] == plan.mode("resident").device_peak
    assert round(own["gpu_bytes"] / 2**30, 2) == 6.30 and round(whole["gpu_bytes"] / 2**30, 2) == 50.10
    config = json.loads((tmp_path / "Qwen3.5-27B" / "config.json").read_text())
    config["text_config"]["num_key_value_heads"] = 8
    copied = tmp_path / "copied"
    copied.mkdir()
    (copied / "config.json").write_text(json.dumps(config))
    eight = hf_memory_plan(copied, tp=8)
    assert plan.stage_params == eight.stage_params
    full = config["text_config"]["layer_types"].count("full_attention")
    assert full == 16 and eight.total_params - plan.total_params == full * 2 * 4 * 256 * 5120
    assert 1 / 8 < own["gpu_bytes"] / whole["gpu_bytes"] < 1.01 / 8


@pytest.mark.parametrize(("tp", "words"), [
    (6, "num_key_value_heads=4 is not a multiple of the tensor-parallel size 6"),
    (16, "num_attention_heads=24 is not a multiple of the tensor-parallel size 16")])
def test_a_tp_that_neither_divides_nor_repeats_the_key_value_heads_is_refused_by_name(cli_run, published, tp, words):
    """Qwen3.5-27B's 4 key/value heads: repeated up to a tp that is a multiple of them and divides
    its 24 query heads (8, 12, 24); neither at 6 (not a multiple of 4) nor 16 (24 query heads)."""
    code, _, err = cli_run("memory", "--hf", str(published("Qwen3.5-27B")), "--teacher-tp", str(tp), "--dp", str(tp))
    assert code != 0 and words in err


@pytest.mark.parametrize(("name", "tp", "pp", "dp"), [("Qwen3.5-27B", 4, 2, 8), ("Qwen3-Next-80B-A3B", 2, 4, 8),
                                                     ("Mixtral-8x7B-v0.1", 1, 2, 8), ("Moonlight-16B-A3B", 1, 3, 6)])
def test_linear_attention_expert_and_multi_latent_families_are_planned_at_a_teacher_pipeline(cli_run, published, name,
                                                                                              tp, pp, dp):
    """Gated-delta-net linear attention (Qwen3.5's layer_types split over the stages), mixtures of
    experts and multi-latent attention with a dense first layer (Moonlight, deepseek_v3) at
    --teacher-pp > 1: planned per stage as the builder builds them."""
    root = str(published(name))
    argv = ("--teacher-tp", str(tp), "--teacher-pp", str(pp), "--dp", str(dp), "--json")
    code, out, err = cli_run("memory", "--hf", root, *argv)
    assert code == 0, err
    report = json.loads(out)
    own, whole = _resident(report)
    plan = hf_memory_plan(root, tp=tp, pp=pp)
    assert (own["tp"], own["pp"], report["teacher_dp"]) == (tp, pp, dp // (tp * pp))
    assert own["gpu_bytes"] == plan.mode("resident").device_peak and len(plan.stage_params) == pp
    # the stage holding the most: about 1/(tp x pp) of the whole (its embedding or output layer, the norms whole)
    assert 1 / (tp * pp) < own["gpu_bytes"] / whole["gpu_bytes"] < 1.06 / (tp * pp)


def test_a_teacher_pipeline_the_layers_do_not_divide_is_refused_by_name(cli_run, published):
    """DeepSeek-V3's 61 layers split over no pipeline of 2 or more stages (uneven stages are not served)."""
    code, _, err = cli_run("memory", "--hf", str(published("DeepSeek-V3")), "--teacher-pp", "2", "--dp", "8")
    assert code != 0 and "num_hidden_layers=61 is not a multiple of the pipeline-parallel size 2" in err


def test_teacher_sizes_need_a_checkpoint(cli_run):
    code, _, err = cli_run("memory", "--params", "8B", "--teacher-tp", "2")
    assert code != 0 and "--teacher-tp / --teacher-pp / --teacher-ep need --hf PATH" in err
