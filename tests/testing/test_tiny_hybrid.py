"""The kit's tiny HybridModel: real megatron-core >= 0.18 attention + MLP layers on CPU that train
through the real DDP and schedule; a clear, skip-able error on older releases."""
import pytest
import torch
from packaging.version import Version

pytestmark = pytest.mark.megatron


def _has_hybrid() -> bool:
    from megatron.core import package_info

    return Version(package_info.__version__) >= Version("0.18")


def test_availability_follows_the_megatron_core_release(megatron_cpu):
    from megatron.core import package_info

    from megatron_rl_patches.testing.megatron_cpu import ModelKindUnavailable

    if _has_hybrid():
        assert megatron_cpu.with_kind("hybrid").kind == "hybrid"
        return
    with pytest.raises(ModelKindUnavailable, match=rf">= 0\.18 .*installed: {package_info.__version__}"):
        megatron_cpu.with_kind("hybrid")
    with pytest.raises(ModelKindUnavailable):
        megatron_cpu.hybrid()
    assert issubclass(ModelKindUnavailable, ImportError)


def test_hybrid_layers_follow_the_pattern_and_train(megatron_cpu):
    if not _has_hybrid():
        pytest.skip("HybridModel needs megatron-core >= 0.18")
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    hybrid = megatron_cpu.with_kind("hybrid")
    model = hybrid.model(megatron_cpu.config(num_layers=4), seed=5)
    assert isinstance(model, HybridModel)
    assert model.decoder.layer_type_list == ["*", "-", "*", "-"]  # the default pattern
    kinds = [type(layer).__name__ for layer in model.decoder.layers]
    assert kinds == ["TransformerLayer", "MLPLayer", "TransformerLayer", "MLPLayer"]
    assert type(model.decoder.final_norm).__module__.startswith("torch.nn")  # not Transformer Engine
    same = megatron_cpu.hybrid(megatron_cpu.config(num_layers=4), seed=5)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters()))

    ddp = megatron_cpu.ddp(model, overlap_grad_reduce=True, use_distributed_optimizer=True)
    ddp.config.no_sync_func = ddp.no_sync
    ddp.config.finalize_model_grads_func = finalize_model_grads
    batches = [megatron_cpu.batch(seed=i) for i in range(2)]
    before = megatron_cpu.run_schedule([ddp], batches)
    assert all(p.main_grad.abs().sum() > 0 for p in ddp.module.parameters())
    megatron_cpu.sgd_step([ddp], lr=0.5)
    ddp.zero_grad_buffer()
    after = megatron_cpu.run_schedule([ddp], batches)
    assert sum(m["lm loss"] for m in after) < sum(m["lm loss"] for m in before)


def test_bad_patterns_and_kinds_are_rejected(megatron_cpu):
    with pytest.raises(ValueError, match=r"kind must be one of \('gpt', 'hybrid'\), got 'mamba'"):
        megatron_cpu.with_kind("mamba")
    from megatron_rl_patches.testing.megatron_cpu import build_tiny_model

    with pytest.raises(ValueError, match="kind must be one of"):
        build_tiny_model("mamba")
    if not _has_hybrid():
        pytest.skip("HybridModel needs megatron-core >= 0.18")
    with pytest.raises(ValueError, match=r"holds \['M'\].*only '\*' \(attention\) and '-' \(MLP\)"):
        megatron_cpu.hybrid(layer_pattern="*M")
    with pytest.raises(ValueError, match="has 3 layers but config.num_layers is 2"):
        megatron_cpu.hybrid(layer_pattern="*-*")
    with pytest.raises(TypeError, match="layer_pattern must be a non-empty str"):
        megatron_cpu.hybrid(layer_pattern="")
    with pytest.raises(ValueError, match="has 2 MTP depths but config.mtp_num_layers is None"):
        megatron_cpu.hybrid(layer_pattern="*-/*-/*-")
