"""converter="mbridge": mbridge 0.15.1's config mapping and load_weights behind the adapters of
inference/loading/hf/mbridge_adapter.py. With mbridge (the `mbridge` lane, `make test-mbridge`):
every family's log-probs equal transformers' own forward to 1e-5 and the builtin converter's
build bit for bit, at TP=1 and (2 gloo ranks) TP=2 / PP=2 / EP=2; two swapped layers fail;
swap/stream equal resident; nothing reaches the hub. Without it (main lane): the keyword's
validation and the ImportError naming the extra."""
from __future__ import annotations

import sys

import pytest
import torch

from megatron_rl_patches import build_inference_model_from_hf
from megatron_rl_patches.inference.loading.hf import UnsupportedCheckpointError
from megatron_rl_patches.testing.hf_checkpoints import (
    save_tiny_hf,
    tiny_hf_config,
    write_swapped_layers,
    write_tiny_checkpoint,
)
from megatron_rl_patches.testing.megatron_cpu import make_batch
from megatron_rl_patches.testing.multirank import run_multirank

VOCAB, SEQ = 1001, 12
TOL = 1e-5
FAMILIES = [("qwen3", {}), ("llama", {}), ("qwen2", {}), ("qwen3_moe", {}), ("qwen3_moe", {"norm_topk_prob": False})]


@pytest.fixture(scope="module")
def mbridge():
    return pytest.importorskip("mbridge", reason="converter='mbridge' needs mbridge 0.15.1 (the lane: make "
                               "test-mbridge, or the wheel's extra [mbridge])")


def needs_mbridge(test):
    """The mbridge lane's marks: skipped with the reason where mbridge is not importable."""
    for mark in (pytest.mark.mbridge, pytest.mark.megatron,
                 pytest.mark.usefixtures("mbridge", "transformers", "moe_router_on_cpu")):
        test = mark(test)
    return test


def _batch():
    return make_batch(batch_size=2, seq_length=SEQ, vocab_size=VOCAB, seed=0)


def _reference(model, batch) -> torch.Tensor:
    with torch.no_grad():
        full = torch.log_softmax(model(batch["tokens"]).logits.double(), dim=-1)
    return full.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)


def _logits(chunk, batch) -> torch.Tensor:
    with torch.no_grad():
        return chunk(batch["tokens"], batch["position_ids"], batch["attention_mask"])


def _log_probs(logits, batch) -> torch.Tensor:
    full = torch.log_softmax(logits[..., :VOCAB].double(), dim=-1)
    return full.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)


def _weights(chunk) -> dict[str, torch.Tensor]:
    return {k: v for k, v in chunk.state_dict().items() if not k.endswith("_extra_state")}


# ---- main lane: no mbridge needed ----

def test_converter_is_validated(tmp_path):
    with pytest.raises(ValueError, match=r"converter must be one of \('builtin', 'mbridge'\), got 'mbrige'"):
        build_inference_model_from_hf(tmp_path, converter="mbrige")


def test_missing_mbridge_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mbridge", None)  # what an environment without the extra sees
    with pytest.raises(ImportError, match=r"converter='mbridge'.*pip install mbridge==0.15.1 .*\.whl\[mbridge\]'"):
        build_inference_model_from_hf(tmp_path / "not-read", converter="mbridge")


# ---- the mbridge lane ----

@needs_mbridge
@pytest.mark.parametrize(("kind", "overrides"), FAMILIES, ids=[k + ("_unnormalized" if o else "") for k, o in FAMILIES])
def test_tp1_equals_transformers_and_the_builtin_converter(megatron_cpu, tmp_path, kind, overrides):
    model = save_tiny_hf(tmp_path, kind, seed=3, **overrides)
    batch = _batch()
    bridged = build_inference_model_from_hf(tmp_path, dtype=torch.float32, converter="mbridge")[0]
    builtin = build_inference_model_from_hf(tmp_path, dtype=torch.float32)[0]
    error = (_log_probs(_logits(bridged, batch), batch) - _reference(model, batch)).abs().max().item()
    assert error < TOL
    assert bridged.config.params_dtype is torch.float32 and not bridged.config.sequence_parallel
    mine, theirs = _weights(bridged), _weights(builtin)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert torch.equal(_logits(bridged, batch), _logits(builtin, batch))


@needs_mbridge
def test_two_swapped_layers_fail(megatron_cpu, tmp_path):
    model = save_tiny_hf(tmp_path / "good", "qwen3", seed=3)
    write_swapped_layers(tmp_path / "good", tmp_path / "bad")
    batch = _batch()
    want = _reference(model, batch)
    for name, limit in (("good", TOL), ("bad", None)):
        chunk = build_inference_model_from_hf(tmp_path / name, dtype=torch.float32, converter="mbridge")[0]
        error = (_log_probs(_logits(chunk, batch), batch) - want).abs().max().item()
        assert error < TOL if limit else error > 1e-2, name


@needs_mbridge
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_swap_and_stream_equal_resident_bit_for_bit(megatron_cpu, tmp_path, kind):
    save_tiny_hf(tmp_path, kind, seed=4)
    batch = _batch()
    want = _logits(build_inference_model_from_hf(tmp_path, dtype=torch.float32, converter="mbridge")[0], batch)
    for residency in ("swap", "stream"):
        chunks = build_inference_model_from_hf(tmp_path, residency=residency, dtype=torch.float32, converter="mbridge")
        assert torch.equal(_logits(chunks[0], batch), want), residency


@needs_mbridge
def test_nothing_reaches_the_hub(megatron_cpu, tmp_path, monkeypatch):
    """mbridge resolves its weights path with transformers' cached_file (a hub lookup for any string
    that is not a directory) and AutoBridge.from_pretrained reads the config through the hub code:
    neither may run."""
    import os

    import mbridge.core.bridge
    import transformers
    import transformers.utils.hub

    def hub(*args, **kwargs):
        raise AssertionError(f"hub lookup {args}")

    monkeypatch.setattr(transformers.utils.hub, "cached_file", hub)
    monkeypatch.setattr(mbridge.core.bridge, "cached_file", hub)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", hub)
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    model = save_tiny_hf(tmp_path, "qwen3", seed=5)
    batch = _batch()
    chunk = build_inference_model_from_hf(tmp_path, dtype=torch.float32, converter="mbridge")[0]
    assert (_log_probs(_logits(chunk, batch), batch) - _reference(model, batch)).abs().max().item() < TOL


@needs_mbridge
def test_unserved_family_and_bad_path_are_refused_before_mbridge(megatron_cpu, tmp_path):
    write_tiny_checkpoint(tmp_path / "mixtral", tiny_hf_config("mixtral"))  # builtin serves it
    with pytest.raises(UnsupportedCheckpointError, match="model_type 'mixtral' is not served by converter='mbridge'"):
        build_inference_model_from_hf(tmp_path / "mixtral", converter="mbridge")
    # mbridge 0.15.1 would map Llama 3.1's RoPE scaling wrong
    write_tiny_checkpoint(tmp_path / "llama3", tiny_hf_config("llama", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}, rope_parameters=None))
    with pytest.raises(UnsupportedCheckpointError, match="RoPE 'llama3' .* is not served by converter='mbridge'"):
        build_inference_model_from_hf(tmp_path / "llama3", converter="mbridge")
    with pytest.raises(FileNotFoundError, match="does not exist"):  # mbridge would take it for a hub id
        build_inference_model_from_hf("Qwen/Qwen3-0.6B", converter="mbridge")


# ---- 2 gloo ranks: TP=2, PP=2, EP=2 (one spawned world, several parallel states in turn) ----

def _full_logits(chunk, batch, tp_group):
    """The logits over the whole padded vocab (gathered over `tp_group`) through megatron-core's
    forward-only schedule, or None off the last pipeline stage."""
    from megatron_rl_patches.inference import inference_forward

    def step(iterator, model):
        next(iterator)
        return model(batch["tokens"], batch["position_ids"], batch["attention_mask"])

    out = inference_forward([chunk], iter([None]), step, collect=lambda logits, _: logits,
                            num_microbatches=1, seq_length=SEQ, micro_batch_size=2)
    if not out:
        return None
    logits = out[0]
    if tp_group is None or torch.distributed.get_world_size(tp_group) == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(torch.distributed.get_world_size(tp_group))]
    torch.distributed.all_gather(parts, logits.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)


def _compare(root: str, batch: dict, tp_group, residencies=("resident",)) -> dict:
    """mbridge against the builtin build: parameters and logits bit for bit, and the log-probs."""
    builtin = build_inference_model_from_hf(root, dtype=torch.float32)[0]
    want = _full_logits(builtin, batch, tp_group)
    out: dict = {}
    for residency in residencies:
        chunk = build_inference_model_from_hf(root, residency=residency, dtype=torch.float32, converter="mbridge")[0]
        mine, theirs = _weights(chunk), _weights(builtin)
        out[f"{residency}_same_weights"] = mine.keys() == theirs.keys() and all(
            torch.equal(mine[k], theirs[k]) for k in mine)
        got = _full_logits(chunk, batch, tp_group)
        out[f"{residency}_same_logits"] = got is None and want is None or torch.equal(got, want)
        out[f"{residency}_log_probs"] = None if got is None else _log_probs(got, batch)
    return out


def _worker(rank: int, world_size: int, root: str, batch: dict) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe import moe_utils

    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    if not hasattr(moe_utils, "te_general_gemm"):  # megatron-core < 0.17 without TE: see conftest
        moe_utils.te_general_gemm = None
    results: dict = {}
    with megatron_on_cpu(tensor_parallel=2):
        group = ps.get_tensor_model_parallel_group()
        results["tp2_qwen3"] = _compare(f"{root}/qwen3", batch, group, ("resident", "stream"))
        for family in ("qwen2", "llama", "qwen3_moe"):
            results[f"tp2_{family}"] = _compare(f"{root}/{family}", batch, group)
    with megatron_on_cpu(pipeline_parallel=2):
        results["pp2_qwen3"] = _compare(f"{root}/qwen3", batch, None, ("resident", "swap"))
        for family in ("qwen2", "llama", "qwen3_moe"):
            results[f"pp2_{family}"] = _compare(f"{root}/{family}", batch, None)
    with megatron_on_cpu():
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
        results["ep2_qwen3_moe"] = _compare(f"{root}/qwen3_moe", batch, None, ("resident", "stream"))
    return results


@pytest.fixture(scope="module")
def world(mbridge, transformers, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    batch = make_batch(batch_size=2, seq_length=SEQ, vocab_size=VOCAB, seed=4)
    reference = {family: _reference(save_tiny_hf(root / family, family, seed=seed), batch)
                 for seed, family in enumerate(("qwen3", "qwen2", "llama", "qwen3_moe"), start=7)}
    return run_multirank(_worker, 2, str(root), batch, timeout=600), reference


@pytest.mark.mbridge
@pytest.mark.megatron
@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2_qwen3", "tp2_qwen2", "tp2_llama", "tp2_qwen3_moe", "pp2_qwen3", "pp2_qwen2",
                                    "pp2_llama", "pp2_qwen3_moe", "ep2_qwen3_moe"])
def test_two_ranks_equal_transformers_and_the_builtin_converter(world, layout):
    results, reference = world
    want = reference[layout.split("_", 1)[1]]
    for rank, result in enumerate(results):
        for key, value in result[layout].items():
            if key.endswith("_log_probs"):
                last_stage = not layout.startswith("pp2") or rank == 1
                assert (value is not None) == last_stage, (rank, key)
                assert value is None or (value - want).abs().max().item() < TOL, (rank, key)
            else:
                assert value is True, (rank, key)
