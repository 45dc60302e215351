"""`bench gpu`: the refusal without CUDA (one line, non-zero exit, no traceback) and the CPU-side
logic run for real on CPU with tiny shapes — interleaved runs, OOM recorded and the run going
on, rows for packages that are not installed, ratios, CSV / markdown / PNG outputs."""
from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl_patches.apps.bench import gpu

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: bench gpu would run")
def test_bench_gpu_refuses_without_cuda_in_one_line():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "megatron_rl_patches", "bench", "gpu", "--quick"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("megatron-rl-patches bench gpu: needs a CUDA device")


def _out_of_memory(x):
    # what the CUDA allocator raises; a real OOM needs a GPU
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB")


def _broken(x):
    raise RuntimeError("kernel exploded")


def test_token_count_rows_record_oom_missing_packages_and_errors_and_go_on():
    impls = [
        ("naive autograd", gpu._naive, None),
        ("logits path", gpu._logits_path, None),
        ("oom stand-in", _out_of_memory, None),
        ("ours, torch tiles", gpu._ours("torch"), None),
        ("absent package", gpu._verl, "a_package_that_is_not_installed"),
        ("broken", _broken, None),
        ("top-k torch tiles", gpu._ours_topk("torch"), None),
    ]
    rows = gpu.with_ratios(gpu.run_token_count(32, 16, 80, 3, "cpu", torch.float32, impls))
    by_label = {row["implementation"]: row for row in rows}
    assert [row["implementation"] for row in rows] == [gpu.GEMM] + [label for label, _, _ in impls]
    assert by_label[gpu.GEMM]["time_ms"] > 0
    assert by_label["oom stand-in"]["note"] == gpu.OOM and "time_ms" not in by_label["oom stand-in"]
    assert by_label["absent package"]["note"] == gpu.NOT_INSTALLED
    assert by_label["broken"]["note"] == "error: RuntimeError: kernel exploded"
    for label in ("naive autograd", "logits path", "ours, torch tiles", "top-k torch tiles"):
        row = by_label[label]
        assert row["time_ms"] > 0 and row["note"] == "", row
        assert "excess_peak_U" not in row  # CPU: the CUDA allocator's peak is not measured
    assert by_label["logits path"]["time_vs_logits"] == 1.0
    assert by_label["ours, torch tiles"]["time_vs_logits"] > 0


def test_measure_once_counts_the_excess_over_the_gradients():
    x = gpu.make_inputs(8, 16, 40, "cpu", torch.float32)

    class Probe:  # the allocator's answer on CUDA: here a known peak of 1 MiB above the start
        cuda = True

        def start(self):
            pass

        def peak(self):
            return 1 << 20

    result = gpu.measure_once(gpu._naive, x, Probe(), lambda: None, iter([1.0, 1.125, 1.25, 2.0, 2.5]).__next__)
    grads = x.hidden.numel() * 4 + x.weight.numel() * 4
    assert result == {"time_s": 0.25, "fwd_s": 0.125, "bwd_s": 0.125, "nograd_s": 0.5,
                      "excess_bytes": (1 << 20) - grads}
    assert x.hidden.grad is None and x.weight.grad is None  # freed for the next run


def test_outputs_are_csv_markdown_and_png(tmp_path):
    rows = gpu.with_ratios([
        {"T": 4096, "implementation": "logits path", "time_ms": 10.0, "excess_peak_U": 1.5, "excess_peak_GiB": 3.7,
         "note": ""},
        {"T": 4096, "implementation": "ours, triton", "time_ms": 12.0, "excess_peak_U": 0.05,
         "excess_peak_GiB": 0.1, "note": ""},
        {"T": 65536, "implementation": "naive autograd", "note": gpu.OOM},
    ])
    paths = gpu.write_outputs(rows, str(tmp_path), "title line")
    with open(tmp_path / "gpu.csv") as fh:
        table = list(csv.DictReader(fh))
    assert list(table[0]) == list(gpu.COLUMNS)
    assert table[1]["time_vs_logits"] == "1.2" and table[2]["note"] == "OOM"
    md = (tmp_path / "gpu.md").read_text()
    assert md.startswith("title line\n\n| T | implementation |") and "| OOM |" in md
    pytest.importorskip("matplotlib")
    assert str(tmp_path / "gpu.png") in paths and (tmp_path / "gpu.png").stat().st_size > 0


def test_every_row_needing_no_extra_package_runs_on_cpu_and_the_invariant_row_is_the_invariant_op():
    """The rows' functions at a tiny shape on CPU (the GPU run's code path, minus the device); the
    invariant mode's row gives the op's invariant bits."""
    from megatron_rl_patches.ops.lm_head import lm_head_log_probs_and_entropy

    x = gpu.make_inputs(64, 32, 300, "cpu", torch.float32)
    rows = {label: fn for label, fn, module in gpu.implementations() if module is None}
    assert gpu.INVARIANT_TILES in rows
    for label, fn in rows.items():
        log_probs, _ = fn(x)
        assert torch.isfinite(log_probs).all(), label
    got, entropy = rows[gpu.INVARIANT_TILES](x)
    want, want_entropy = lm_head_log_probs_and_entropy(x.hidden, x.weight, x.tokens, with_entropy=True,
                                                       invariant=True)
    assert torch.equal(got, want) and torch.equal(entropy, want_entropy)


def test_a_topk_row_runs_both_of_its_ops_on_its_backend(monkeypatch):
    """The top-k row's ids as well as its log-probs on the row's backend: the H200 run's torch-tiles
    row took its ids from `auto` (the Triton kernel on CUDA) and showed the kernel's peak."""
    from megatron_rl_patches.ops import lm_head

    asked = []
    for name in ("lm_head_topk_ids", "lm_head_topk_logprobs"):
        real = getattr(lm_head, name)
        monkeypatch.setattr(lm_head, name, lambda *a, _real=real, _name=name, **kw:
                            asked.append((_name, kw.get("backend"))) or _real(*a, **kw))
    gpu._ours_topk("torch")(gpu.make_inputs(8, 16, 2 * gpu.TOPK, "cpu", torch.float32))
    assert asked == [("lm_head_topk_ids", "torch"), ("lm_head_topk_logprobs", "torch")]


def test_a_line_per_case_as_it_ends_the_gemm_first_and_ratios_to_it():
    """A fake clock and case list: the GEMM's line comes first, each case's line before the next
    case runs (a case sees every earlier line printed), its phases apart and their ratios to the
    GEMM; a peer that does not import says why in its line; slow rows skipped unless asked."""
    ticks = iter(float(i) for i in range(10_000))
    lines: list[str] = []
    seen_when_run: dict[str, int] = {}

    def case(label):
        def fn(x):
            seen_when_run.setdefault(label, len(lines))
            return x.hidden.float().sum(1), None
        return fn

    impls = [("first", case("first"), None), ("peer", case("peer"), "a_peer_that_is_not_installed"),
             (gpu.SLOW[0], case("slow"), None), ("last", case("last"), None)]
    rows = gpu.run_token_count(8, 4, 16, 2, "cpu", torch.float32, impls, emit=lambda r: lines.append(gpu.line(r)),
                               slow=False, clock=lambda: next(ticks))
    assert len(lines) == 5 and lines[0].startswith("T=     8  " + gpu.GEMM)
    assert seen_when_run == {"first": 1, "last": 4}  # each case ran after every earlier line was out
    assert "not installed: ModuleNotFoundError: No module named 'a_peer_that_is_not_installed'" in lines[2]
    assert gpu.SKIPPED_SLOW in lines[3]
    first = rows[1]
    # the fake clock ticks once a call: GEMM 1 s a run; fwd 1, bwd 1, no-grad 1 s
    assert (first["fwd_ms"], first["bwd_ms"], first["nograd_ms"]) == (1000.0, 1000.0, 1000.0)
    assert first["nograd_vs_gemm"] == 1.0 and first["total_vs_4gemm"] == 0.5
    assert "no-grad fwd 1000.0 ms  1.00x GEMM  fwd+bwd 0.50x 4 GEMMs" in lines[1]


def test_slow_is_a_bench_gpu_option():
    from megatron_rl_patches.apps.cli import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args(["gpu", "--quick", "--slow"]).slow
    with pytest.raises(bench.UsageError, match="--slow belongs to `bench gpu`"):
        bench.check_options(parser.parse_args(["fused", "--slow"]))
