"""training_state_bytes: the per-rank training-state formula, against an independent reference and
against the grad buffer real megatron-core allocates."""
import json
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl_patches.inference.sizing.memory import training_state_bytes

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def reference_bytes(n: int, dp: int, dist_opt: bool, param: str, grad: str) -> dict:
    """Written from the rule, not from the implementation: grads whole on every rank; fp32 main
    params (only for 16-bit weights) and Adam m, v sharded over dp with the distributed optimizer."""
    per_rank = math.ceil(n / dp) if dist_opt else n
    return {
        "grad_buffer": n * BYTES[grad],
        "main_params": 0 if param == "fp32" else 4 * per_rank,
        "adam_m": 4 * per_rank,
        "adam_v": 4 * per_rank,
    }


def test_issue_cross_checks():
    bf16 = training_state_bytes(27e9)
    assert bf16.total == 432 * 10**9 and bf16.bytes_per_param == 16.0
    assert bf16.saved == bf16.total and bf16.inference_only == 0
    assert bf16.weights == 54 * 10**9
    fp32 = training_state_bytes(27e9, param_dtype="fp32")
    assert fp32.bytes_per_param == 12.0 and fp32.main_params == 0
    assert training_state_bytes(27e9, param_dtype="fp16").bytes_per_param == 16.0
    assert training_state_bytes(27e9, grad_dtype="bf16").bytes_per_param == 14.0
    sharded = training_state_bytes(70e9, dp=8, distributed_optimizer=True)
    assert sharded.bytes_per_param == 4 + 12 / 8
    assert training_state_bytes(70e9, dp=8).bytes_per_param == 16.0  # dp alone shards nothing


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(min_value=0, max_value=10**13),
    dp=st.integers(min_value=1, max_value=4096),
    dist_opt=st.booleans(),
    param=st.sampled_from(["fp32", "bf16", "fp16"]),
    grad_fp32=st.booleans(),
)
def test_formula_matches_reference(n, dp, dist_opt, param, grad_fp32):
    grad = "fp32" if grad_fp32 else param
    report = training_state_bytes(n, dp=dp, distributed_optimizer=dist_opt, param_dtype=param, grad_dtype=grad)
    expected = reference_bytes(n, dp, dist_opt, param, grad)
    assert {k: getattr(report, k) for k in expected} == expected
    assert report.total == sum(expected.values()) == report.saved
    assert report.weights == n * BYTES[param]
    if n:  # bytes/param in float64 against the unsharded rule, up to the ceil of one shard
        per_param = BYTES[grad] + ((0 if param == "fp32" else 4) + 8) / (dp if dist_opt else 1)
        assert abs(report.bytes_per_param - per_param) <= 12 / n + 1e-12


def test_dtypes_by_name_or_torch_dtype():
    torch = pytest.importorskip("torch")
    report = training_state_bytes(10, param_dtype=torch.bfloat16, grad_dtype="float32")
    assert (report.param_dtype, report.grad_dtype) == ("bf16", "fp32")


def test_plain_module_counts_unique_parameters_and_their_dtype():
    torch = pytest.importorskip("torch")
    shared = torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(shared, shared, torch.nn.Linear(4, 2, bias=False)).to(torch.bfloat16)
    report = training_state_bytes(model)
    assert report.num_params == 20 + 8 and report.param_dtype == "bf16"
    assert report.counted_grad_buffer is None and report.grad_buffer_padding is None
    mixed = training_state_bytes([model, torch.nn.Linear(2, 1)])
    assert mixed.num_params == 28 + 3 and mixed.param_dtype == "bf16"  # the dtype of most parameters
    assert training_state_bytes(model, param_dtype="fp32").param_dtype == "fp32"  # explicit wins


@pytest.mark.parametrize(
    "value, kwargs, error, match",
    [
        (-1, {}, ValueError, "whole, non-negative"),
        (1.5, {}, ValueError, "whole, non-negative"),
        (float("nan"), {}, ValueError, "whole, non-negative"),
        (True, {}, TypeError, "number of parameters"),
        ("27e9", {}, TypeError, "number of parameters"),
        ([], {}, ValueError, "empty list"),
        (10, {"dp": 0}, ValueError, "dp must be a positive int"),
        (10, {"dp": 2.0}, ValueError, "dp must be a positive int"),
        (10, {"param_dtype": "int8"}, ValueError, "param_dtype must be one of"),
        (10, {"param_dtype": "fp32", "grad_dtype": "bf16"}, ValueError, "grad buffer is fp32"),
        (10, {"param_dtype": "bf16", "grad_dtype": "fp16"}, ValueError, "grad buffer is fp32"),
        (10, {"distributed_optimizer": "yes"}, TypeError, "distributed_optimizer must be a bool"),
    ],
)
def test_bad_inputs_raise_clearly(value, kwargs, error, match):
    with pytest.raises(error, match=match):
        training_state_bytes(value, **kwargs)


def test_report_as_json():
    data = json.loads(json.dumps(training_state_bytes(27e9).as_dict()))
    assert data["total"] == 432 * 10**9 and data["saved"] == data["total"] and data["bytes_per_param"] == 16.0


def test_memory_module_imports_no_torch():
    code = (
        "import sys, megatron_rl_patches.apps.cli.memory, megatron_rl_patches.inference.sizing.memory; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.megatron
def test_memory_formula_matches_counted_grad_buffer_up_to_named_padding(megatron_cpu_kind):
    """The formula against the grad buffer real megatron-core allocates (CPU)."""
    import torch

    from megatron_rl_patches import build_inference_model, training_state_bytes
    from megatron_rl_patches.apps.presentation import memory_report as format_report

    model = megatron_cpu_kind.model(seed=0)
    n = sum(p.numel() for p in model.parameters())

    plain = training_state_bytes(megatron_cpu_kind.ddp(model))
    assert plain.num_params == n and plain.dp == 1 and not plain.distributed_optimizer
    assert (plain.param_dtype, plain.grad_dtype) == ("fp32", "fp32")
    assert plain.counted_grad_buffer == plain.grad_buffer == 4 * n  # no padding without the dist. optimizer
    assert plain.grad_buffer_padding == 0 and sum(plain.padding.values()) == 0
    assert plain.main_params == 0 and plain.adam_m == plain.adam_v == 4 * n and plain.total == 12 * n

    flags = dict(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=4000)
    sharded = training_state_bytes(megatron_cpu_kind.ddp(megatron_cpu_kind.model(seed=0), **flags))
    assert sharded.distributed_optimizer and sharded.grad_buffer == 4 * n
    assert sharded.grad_buffer_padding > 0
    assert sharded.counted_grad_buffer - sharded.grad_buffer == sum(sharded.padding.values())
    assert all(value >= 0 for value in sharded.padding.values())
    assert sharded.padding["bucket end (multiple of lcm(dp, 128))"] > 0
    text = format_report(sharded)
    assert "padding" in text and f"{sharded.grad_buffer_padding:,} B" in text

    config = megatron_cpu_kind.config(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    from megatron.core.transformer.module import Float16Module

    wrapped = Float16Module(config, megatron_cpu_kind.model(config, seed=0))
    ddp16 = megatron_cpu_kind.ddp(wrapped, grad_reduce_in_fp32=True)
    bf16 = training_state_bytes(ddp16)
    assert (bf16.param_dtype, bf16.grad_dtype) == ("bf16", "fp32") and bf16.total == 16 * n
    assert bf16.counted_grad_buffer == 4 * n

    # the shared chunk helpers on real wrappers: both DDP checks hold on DDP only, unwrap strips both
    from megatron_rl_patches.model.chunks import has_grad_buffers, is_ddp_like, iter_wrapped, unwrap

    assert is_ddp_like(ddp16) and has_grad_buffers(ddp16)
    assert not is_ddp_like(wrapped) and not has_grad_buffers(wrapped)
    chain = [type(m).__name__ for m in iter_wrapped(ddp16)]
    model_class = {"gpt": "GPTModel", "hybrid": "HybridModel"}[megatron_cpu_kind.kind]
    assert chain == ["DistributedDataParallel", "Float16Module", model_class]
    assert unwrap(ddp16) is wrapped.module and unwrap(wrapped.module) is wrapped.module

    frozen = build_inference_model(megatron_cpu_kind.model_provider(config, seed=0))
    estimate = training_state_bytes(frozen)  # what training this build would add
    assert estimate.num_params == n and estimate.param_dtype == "bf16" and estimate.counted_grad_buffer is None
    assert not is_ddp_like(frozen[0]) and unwrap(frozen[0]) is frozen[0].module  # no DDP hooks to toggle
    frozen_ddp = megatron_cpu_kind.ddp(frozen[0].module)
    assert training_state_bytes(frozen_ddp).num_params == 0  # DDP of a frozen model: no buffer

    with pytest.raises(ValueError, match="dp=8 contradicts the DDP model"):
        training_state_bytes(megatron_cpu_kind.ddp(megatron_cpu_kind.model(seed=0)), dp=8)
