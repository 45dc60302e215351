"""`bench`'s options are honoured or refused: an option of `bench ops` given to another benchmark,
or `--quick` given to `bench ops`, is a usage error (exit 2) before anything runs; a benchmark
prints a line per case as it ends."""
from __future__ import annotations

import contextlib
import io

import pytest

from megatron_rl_patches.apps import cli
from megatron_rl_patches.apps.bench import runner


def _main(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, err.getvalue()


@pytest.mark.parametrize("argv", [
    ["bench", "logprobs", "--T", "64"], ["bench", "residency", "--runs", "2"], ["bench", "--baseline", "main"],
    ["bench", "fused", "--V", "128", "--H", "8"], ["bench", "ops", "--quick"],
])
def test_an_option_the_benchmark_does_not_read_is_a_usage_error(argv):
    code, err = _main(argv)
    assert code == cli.USAGE, err
    assert ("belong" in err and "bench ops" in err) or "bench ops has no --quick" in err


def test_each_case_reports_as_it_ends(capsys):
    cases = [{"target": "tests.apps.cli.test_bench_options:tiny_case", "kwargs": {"n": n}} for n in (1, 2)]
    rows = runner.run_cases(cases, isolate=False)
    assert rows == [{"n": 1}, {"n": 2}]
    err = capsys.readouterr().err
    assert "case 1/2 done" in err and "case 2/2 done" in err and "tiny_case n=2" in err


def test_a_failing_worker_reports_every_case_it_did_not_finish(capsys):
    cases = [{"target": "tests.apps.cli.test_bench_options:no_such_case", "kwargs": {}}]
    rows = runner.run_cases(cases)
    assert rows[0]["error"].startswith("AttributeError") or "no_such_case" in rows[0]["error"]
    assert "case 1/1 failed" in capsys.readouterr().err


def tiny_case(probe: object, n: int) -> dict:
    return {"n": n}


