"""`megatron-rl-patches memory`: the sub-command contract, output and errors."""
import argparse
import json

import pytest
from kit.cli import run_memory_cli

from megatron_rl_patches.apps.cli import memory as memory_cli


def test_default_table_matches_the_issue(capsys):
    code, out, err = run_memory_cli(["--params", "27e9"], capsys)
    assert code == 0 and err == ""
    assert "27,000,000,000 parameters, bf16 weights, fp32 grads, DP=1" in out
    total = next(line for line in out.splitlines() if line.startswith("total beyond the weights"))
    assert total.split()[-6:] == ["402.33", "GiB", "0", "B", "402.33", "GiB"]  # 432e9 B
    per_param = next(line for line in out.splitlines() if line.startswith("bytes per parameter"))
    assert per_param.split()[-3:] == ["16.00", "0.00", "16.00"]


def test_fp32_weights_and_sharded_optimizer(capsys):
    code, out, _ = run_memory_cli(["--params", "27B", "--param-dtype", "fp32", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["total"] == 324 * 10**9 and data["bytes_per_param"] == 12.0 and data["main_params"] == 0
    code, out, _ = run_memory_cli(["--params", "70B", "--dp", "8", "--distributed-optimizer", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["dp"] == 8 and data["distributed_optimizer"] is True
    assert data["adam_m"] == 4 * 70 * 10**9 // 8 and data["bytes_per_param"] == 5.5


@pytest.mark.parametrize(
    "text, value",
    [("27e9", 27 * 10**9), ("27B", 27 * 10**9), ("7.5b", 7_500_000_000), ("1500M", 1_500_000_000),
     ("70000000000", 70 * 10**9), ("2.7e10", 27 * 10**9), ("1T", 10**12), ("3k", 3000),
     # real sizes that are not exact in binary floating point (8.03 * 1e9 = 8030000000.000001)
     ("8.03B", 8_030_000_000), ("0.56B", 560_000_000), ("1.1b", 1_100_000_000), ("6.74B", 6_740_000_000),
     ("123456789012345678901", 123456789012345678901), ("0.001e12", 10**9)],
)
def test_param_counts(text, value):
    assert memory_cli.parse_param_count(text) == value


@pytest.mark.parametrize("text", ["abc", "0", "1.5", "-3", "27 bn", "", "8.0300000001B", "0.5", "1e-3",
                                  "1e999999999", "1e-999999999", "nan", "inf"])
def test_bad_param_counts(text):
    with pytest.raises(argparse.ArgumentTypeError, match="invalid parameter count"):
        memory_cli.parse_param_count(text)


def test_usage_errors_exit_2(capsys):
    code, out, err = run_memory_cli(["--params", "27e9", "--dp", "0"], capsys)
    assert code == 2 and "invalid data-parallel size" in err and out == ""
    code, _, err = run_memory_cli(["--params", "lots"], capsys)
    assert code == 2 and "invalid parameter count" in err
    code, _, err = run_memory_cli([], capsys)
    assert code == 2 and "--params" in err


@pytest.mark.parametrize("text", ["0", "-2", "1.5", "two", ""])
def test_bad_dp_is_a_usage_error(text):
    with pytest.raises(argparse.ArgumentTypeError,
                       match=f"invalid data-parallel size {text!r}: must be an integer >= 1"):
        memory_cli._positive(text)
    assert memory_cli._positive(" 8 ") == 8


def test_inconsistent_dtypes_are_refused(capsys):
    code, out, err = run_memory_cli(["--params", "7B", "--param-dtype", "fp32", "--grad-dtype", "bf16"], capsys)
    assert code == 2 and out == "" and "grad buffer is fp32" in err


def test_module_contract():
    parser = argparse.ArgumentParser()
    memory_cli.add_arguments(parser)
    args = parser.parse_args(["--params", "1e3", "--grad-dtype", "bf16"])
    assert memory_cli.run(args) == 0
