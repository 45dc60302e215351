"""The CPU shims: the stream stand-ins behave as no-ops, type names read `torch.cuda.*`,
and every patched attribute is restored (or removed again) on exit, also after an error."""
import pytest
import torch

pytestmark = pytest.mark.megatron


def _snapshot() -> dict:
    from megatron_rl_patches.testing.shims import _shim_table

    return {(id(owner), name): vars(owner).get(name, "<absent>") for owner, name, _ in _shim_table()}


def test_streams_are_cpu_no_ops_and_what_works_on_cpu_is_left_alone():
    from megatron_rl_patches.testing.shims import cpu_shims

    untouched = {name: getattr(torch.cuda, name) for name in ("stream", "Event", "empty_cache", "memory_allocated")}
    with cpu_shims():
        current = torch.cuda.current_stream()
        assert current is torch.cuda.current_stream(0)
        side = torch.cuda.Stream(device=torch.cuda.current_device())
        event = side.record_event()
        assert current.wait_event(event) is None and current.wait_stream(side) is None
        assert event.query() and event.wait(current) is None and side.synchronize() is None
        with torch.cuda.stream(side):  # torch's own context: Megatron-LM's get_model builds DDP so
            made = torch.ones(2, device="cuda")
        assert made.device.type == "cpu"
        assert torch.cuda.synchronize() is None
        assert {name: getattr(torch.cuda, name) for name in untouched} == untouched


def test_module_cuda_and_tensor_type_names():
    from megatron_rl_patches.testing.shims import cpu_shims

    layer = torch.nn.Linear(2, 2)
    with cpu_shims():
        assert layer.cuda(torch.cuda.current_device()) is layer and layer.weight.device.type == "cpu"
        assert layer.weight.type() == "torch.cuda.FloatTensor"  # what megatron's optimizers compare
        assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        converted = torch.ones(2).type("torch.cuda.DoubleTensor")
        assert converted.dtype == torch.float64 and converted.device.type == "cpu"
        assert torch.ones(2).type(torch.int32).dtype == torch.int32
    assert layer.weight.type() == "torch.FloatTensor"


def test_everything_is_restored_on_exit_and_after_an_error():
    from megatron_rl_patches.testing.shims import cpu_shims

    before = _snapshot()
    assert "type" not in vars(torch.Tensor)  # inherited from the C base class
    with cpu_shims():
        assert _snapshot() != before
        assert "type" in vars(torch.Tensor)
    assert _snapshot() == before and "type" not in vars(torch.Tensor)

    with pytest.raises(ZeroDivisionError):
        with cpu_shims():
            _ = 1 / 0
    assert _snapshot() == before
    assert torch.ones(1, device="cpu").type() == "torch.FloatTensor"


def test_the_moe_router_takes_the_torch_matmul():
    """megatron-core < 0.17 without Transformer Engine leaves `te_general_gemm` undefined and its
    router raises NameError; under the shims it is None (the router's torch branch)."""
    from megatron.core.transformer.moe import moe_utils

    from megatron_rl_patches.testing.shims import cpu_shims

    with cpu_shims():
        assert moe_utils.te_general_gemm is None
        weight, rows = torch.randn(4, 8), torch.randn(3, 8)
        logits = moe_utils.router_gating_linear(rows, weight, None, torch.float32) if _takes_bias() else \
            moe_utils.router_gating_linear(rows, weight, torch.float32)
        torch.testing.assert_close(logits, rows @ weight.t())


def _takes_bias() -> bool:
    import inspect

    from megatron.core.transformer.moe import moe_utils

    return "bias" in inspect.signature(moe_utils.router_gating_linear).parameters


def test_a_positional_cuda_device_in_tensor_to_stays_on_cpu():
    """NeMo-RL moves its batches with `data_dict.to("cuda")`: the device positional, not a keyword."""
    from megatron_rl_patches.testing.shims import CudaToCpuMode

    value = torch.arange(3)
    with CudaToCpuMode():
        moved = [value.to("cuda"), value.to(torch.device("cuda", 0)), value.to("cuda", torch.float64)]
        kept = value.to(torch.float16)
    assert all(t.device.type == "cpu" for t in moved) and moved[2].dtype == torch.float64
    assert kept.dtype == torch.float16
    with pytest.raises((RuntimeError, AssertionError)):  # negative control: without the mode, no CUDA here
        value.to("cuda")
