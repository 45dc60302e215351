"""`megatron-rl-patches memory --residency MODE --layers N`: device and host weight bytes per
residency mode, from the planner (no torch needed), and its usage errors."""
import json

import pytest
from kit.cli import run_memory_cli

from megatron_rl_patches.inference.sizing.residency_plan import residency_plan


def test_stream_table_for_a_27b_model(capsys):
    code, out, err = run_memory_cli(["--params", "27e9", "--residency", "stream", "--layers", "64"], capsys)
    assert code == 0 and err == ""
    lines = [line for line in out.splitlines() if line.lstrip("* ").split(" ")[0] in ("resident", "swap", "stream")]
    rows = {line.lstrip("* ").split()[0]: line.lstrip("* ").split()[1:] for line in lines}
    assert [line[:2] for line in lines] == ["  ", "  ", "* "]  # the chosen mode marked
    assert rows["resident"] == ["50.29", "GiB", "50.29", "GiB", "0", "B"]
    assert rows["swap"] == ["50.29", "GiB", "0", "B", "50.29", "GiB"]
    assert rows["stream"] == ["1.57", "GiB", "0", "B", "50.29", "GiB"]  # 2 layers of 27e9 / 64 in bf16
    assert "each rank keeps its own pinned copy" in out


def test_json_and_the_planner_agree():
    plan = residency_plan(27 * 10**9, layers=64, prefetch=2, vocab_size=262144, hidden_size=5376, tied=True, tp=2)
    table = 262144 * 5376
    per_layer = -(-(27 * 10**9 - table) // 64)
    assert plan.layer_bytes == per_layer  # bf16 over TP=2: 2 bytes / 2 ranks
    assert plan.output_bytes == 0 and plan.embedding_bytes == table
    assert plan.mode("stream").device_peak == 3 * per_layer + table
    assert plan.mode("swap").host == plan.mode("resident").device_peak == 27 * 10**9


def test_json_output(capsys):
    code, out, _ = run_memory_cli(["--params", "7B", "--residency", "swap", "--layers", "32", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["residency"] == "swap" and data["total"] == 16 * 7 * 10**9
    assert data["residency_plan"]["modes"]["swap"] == {
        "mode": "swap", "device_peak": 14 * 10**9, "device_between_phases": 0, "host": 14 * 10**9}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--residency", "stream"], "--residency needs --layers N"),
        (["--residency", "offload", "--layers", "4"], "invalid choice: 'offload'"),
        (["--residency", "stream", "--layers", "0"], "invalid --layers '0'"),
        (["--residency", "stream", "--layers", "4", "--prefetch", "-1"], "invalid --prefetch '-1'"),
        (["--residency", "stream", "--layers", "4", "--vocab", "1000"], "give vocab_size and hidden_size together"),
        (["--residency", "stream", "--layers", "4", "--vocab", "10000000", "--hidden", "10000"],
         "leaves nothing for the layers"),
        (["--residency", "stream", "--layers", "100", "--params", "10"], "fewer than one per layer"),
        (["--layers", "4"], "--layers only sizes the residency plan"),
        (["--prefetch", "2"], "--prefetch only sizes"),
        (["--tied", "--tp", "2"], "--tied, --tp only size the residency plan"),
        (["--vocab", "1000", "--hidden", "64"], "--vocab, --hidden only size"),
    ],
)
def test_usage_errors(capsys, argv, message):
    code, out, err = run_memory_cli(["--params", "27e9", *argv], capsys)
    assert code == 2 and message in err and out == ""


def test_planner_argument_errors():
    with pytest.raises(ValueError, match="layers must be a positive int"):
        residency_plan(10**9, layers=0)
    with pytest.raises(ValueError, match="prefetch must be an int >= 0"):
        residency_plan(10**9, layers=4, prefetch=True)
