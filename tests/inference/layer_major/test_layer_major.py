"""score_layer_major on real megatron-core (CPU): bit for bit the per-micro-batch forward (logits,
fused log-probs, top-k buckets; GPTModel, HybridModel where megatron-core has it, packed `thd`
input), with hidden states spilled to host beyond the activation budget, and its errors."""
from __future__ import annotations

import pytest
import torch

import megatron_rl_patches
from megatron_rl_patches import log_prob_output_processor, score_layer_major, topk_output_processor
from megatron_rl_patches.inference.layer_major.activation_store import ActivationStats
from megatron_rl_patches.testing import layouts

pytestmark = pytest.mark.megatron

SIZES = (2, 1, 3)  # micro-batches may differ in size, not in structure


def _batches(env, sizes=SIZES) -> list[dict]:
    batches = []
    for seed, size in enumerate(sizes):
        batch = env.batch(batch_size=size, seed=seed)
        batches.append({"input_ids": batch["tokens"], "position_ids": batch["position_ids"],
                        "attention_mask": batch["attention_mask"], "labels": batch["labels"]})
    return batches


def _per_micro_batch(chunk, batches, **kwargs) -> list:
    with torch.no_grad():
        return [chunk(**batch, **kwargs) for batch in batches]


def _assert_identical(got, want) -> None:
    assert len(got) == len(want)
    for one, other in zip(got, want):
        if isinstance(other, dict):
            assert one.keys() == other.keys()
            for key in other:
                assert (one[key] is None) == (other[key] is None), key
                assert other[key] is None or torch.equal(one[key], other[key]), key
        else:
            assert torch.equal(one, other)


def _clean(decoder) -> bool:
    """No shadowing attribute left on the decoder after a call."""
    return not {"forward", "layers", "final_layernorm", "final_norm"} & set(vars(decoder))


@layouts.mark("bshd")
def test_logits_equal_per_micro_batch_bit_for_bit(megatron_cpu_kind):
    chunks = megatron_rl_patches.build_inference_model(
        megatron_cpu_kind.model_provider(megatron_cpu_kind.config(num_layers=3), seed=5))
    batches = [{k: v for k, v in batch.items() if k != "labels"} for batch in _batches(megatron_cpu_kind)]
    snapshot = [{k: v.clone() for k, v in batch.items()} for batch in batches]

    got = score_layer_major(chunks, batches)

    _assert_identical(got, _per_micro_batch(chunks[0], batches))
    assert got[1].shape == (1, 16, 64) and not got[0].requires_grad
    for batch, before in zip(batches, snapshot):  # the caller's tensors untouched
        assert all(torch.equal(batch[k], before[k]) for k in before)
    assert _clean(chunks[0].decoder)  # fp32: no Float16Module around the model


def test_losses_with_labels_equal_per_micro_batch(megatron_cpu):
    chunks = megatron_rl_patches.build_inference_model(megatron_cpu.provider(seed=6))
    batches = _batches(megatron_cpu)
    _assert_identical(score_layer_major(chunks, batches), _per_micro_batch(chunks[0], batches))


@layouts.mark("bshd")
def test_processors_equal_per_micro_batch_bit_for_bit(megatron_cpu_kind, clean_patch_state):
    # GPTModel's hook (`native` on megatron-core >= 0.18) and HybridModel's
    megatron_rl_patches.apply(only=["gpt_output_processor", "hybrid_output_processor"])
    env = megatron_cpu_kind
    chunks = megatron_rl_patches.build_inference_model(env.model_provider(env.config(num_layers=3), seed=7))
    batches = _batches(env)

    processor = log_prob_output_processor(temperature=0.7, with_entropy=True)
    got = score_layer_major(chunks, batches, output_processor=processor)
    _assert_identical(got, _per_micro_batch(chunks[0], batches, output_processor=processor))
    assert got[2]["log_probs"].shape == (3, 16)

    # a teacher scoring each micro-batch's own ids: one context per micro-batch
    gen = torch.Generator().manual_seed(8)
    contexts = [{"ids": torch.rand(size, 16, 64, generator=gen).argsort(-1)[..., :4]} for size in SIZES]
    topk = topk_output_processor()
    got = score_layer_major(chunks, batches, output_processor=topk, output_processor_context=contexts)
    want = [chunks[0](**batch, output_processor=topk, output_processor_context=context)
            for batch, context in zip(batches, contexts)]
    _assert_identical(got, [{k: v.detach() for k, v in w.items()} for w in want])
    selecting = topk_output_processor(k=3)  # one context (None) shared by every micro-batch
    _assert_identical(score_layer_major(chunks, batches, output_processor=selecting),
                      _per_micro_batch(chunks[0], batches, output_processor=selecting))


def _packed_batches(lengths_per_micro_batch, vocab=64) -> list[dict]:
    from megatron.core.packed_seq_params import PackedSeqParams

    gen = torch.Generator().manual_seed(9)
    batches = []
    for lengths in lengths_per_micro_batch:
        total = sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
        tokens = torch.randint(0, vocab, (1, total + 1), generator=gen)
        batches.append({
            "input_ids": tokens[:, :-1], "labels": tokens[:, 1:],
            "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
            "attention_mask": None, "packed_seq_params": params,
        })
    return batches


@layouts.mark("thd")
def test_packed_thd_batches_equal_per_micro_batch(megatron_cpu, clean_patch_state):
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    megatron_rl_patches.apply(only="gpt_output_processor")
    chunks = megatron_rl_patches.build_inference_model(
        lambda pre_process=True, post_process=True: build_packed_gpt(seed=10, num_layers=3))
    batches = _packed_batches([(5, 9, 3), (12,), (4, 4, 6, 2)])
    logits_batches = [{k: v for k, v in batch.items() if k != "labels"} for batch in batches]
    _assert_identical(score_layer_major(chunks, logits_batches), _per_micro_batch(chunks[0], logits_batches))
    processor = log_prob_output_processor(with_entropy=True)
    _assert_identical(score_layer_major(chunks, batches, output_processor=processor, activation_budget=0),
                      _per_micro_batch(chunks[0], batches, output_processor=processor))


def test_hidden_states_beyond_the_budget_wait_on_host_and_stay_bit_equal(megatron_cpu):
    provider = megatron_cpu.provider(megatron_cpu.config(num_layers=3), seed=11)
    chunks = megatron_rl_patches.build_inference_model(provider)
    batches = _batches(megatron_cpu, sizes=(2, 2, 2, 2))
    one = 16 * 2 * 32 * 4  # a micro-batch's hidden states: [s, b, h] fp32
    want = _per_micro_batch(chunks[0], batches)

    stats = ActivationStats()
    _assert_identical(score_layer_major(chunks, batches, activation_budget=one + one // 2, stats=stats), want)
    assert stats.budget == one + one // 2 and stats.device_bytes_peak == one
    # three of four micro-batches spill: after the embedding and after each of the 3 layers
    assert stats.bytes_to_host == 3 * one * 4 and stats.bytes_to_device == stats.bytes_to_host
    assert stats.host_bytes_peak == 3 * one

    unlimited = ActivationStats()
    _assert_identical(score_layer_major(chunks, batches, stats=unlimited), want)
    assert unlimited.device_bytes_peak == 4 * one and unlimited.bytes_to_host == 0


def test_bad_input_is_refused_and_the_model_left_usable(megatron_cpu, clean_patch_state):
    chunks = megatron_rl_patches.build_inference_model(megatron_cpu.provider(seed=12))
    batches = _batches(megatron_cpu)
    with pytest.raises(ValueError, match="batches is empty"):
        score_layer_major(chunks, [])
    with pytest.raises(TypeError, match="batches must be a list of micro-batches"):
        score_layer_major(chunks, batches[0])
    with pytest.raises(ValueError, match=r"batches\[1\] has keys"):
        score_layer_major(chunks, [batches[0], {k: v for k, v in batches[1].items() if k != "labels"}])
    with pytest.raises(ValueError, match=r"batches\[2\]\['labels'\] is None but batches\[0\]\['labels'\] is a 2-d"):
        score_layer_major(chunks, [*batches[:2], {**batches[2], "labels": None}])
    with pytest.raises(ValueError, match="passes these itself"):
        score_layer_major(chunks, [{**batches[0], "decoder_input": None}])
    with pytest.raises(ValueError, match="activation_budget must be None"):
        score_layer_major(chunks, batches, activation_budget=-1)
    with pytest.raises(ValueError, match="list of 2 contexts but there are 3 micro-batches"):
        score_layer_major(chunks, batches, output_processor=topk_output_processor(), output_processor_context=[{}, {}])
    with pytest.raises(ValueError, match="without an output_processor"):
        score_layer_major(chunks, batches, output_processor_context={})
    with pytest.raises(TypeError, match="output_processor must be callable"):
        score_layer_major(chunks, batches, output_processor="log_probs")

    def failing(**kwargs):
        raise RuntimeError("processor failed")

    megatron_rl_patches.apply(only="gpt_output_processor")
    with pytest.raises(RuntimeError, match="processor failed"):
        score_layer_major(chunks, batches, output_processor=failing)
    assert _clean(chunks[0].decoder)
    _assert_identical(score_layer_major(chunks, batches), _per_micro_batch(chunks[0], batches))


def test_an_error_mid_rollout_leaves_nothing_on_the_device(megatron_cpu, clean_patch_state):
    from megatron_rl_patches import residency_report
    from megatron_rl_patches.inference.residency.storage import device_weight_bytes

    megatron_rl_patches.apply(only="gpt_output_processor")
    provider = megatron_cpu.provider(megatron_cpu.config(num_layers=2), seed=19)
    resident = megatron_rl_patches.build_inference_model(provider)
    chunks = megatron_rl_patches.build_inference_model(provider, residency="stream")
    batches = _batches(megatron_cpu)
    calls = []

    def fails_on_the_second(**kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("processor failed")
        return kwargs["hidden_states"].sum()

    with pytest.raises(RuntimeError, match="processor failed") as failure:
        score_layer_major(chunks, batches, output_processor=fails_on_the_second)
    # released by the scorer itself, not by the collector: the traceback (and its frames) is alive
    assert failure.tb is not None and device_weight_bytes(chunks[0].parameters()) == 0
    assert residency_report(chunks).activation_bytes == 0 and _clean(chunks[0].decoder)
    _assert_identical(score_layer_major(chunks, batches), _per_micro_batch(resident[0], batches))


def test_models_that_are_not_one_frozen_chunk_are_refused(megatron_cpu, monkeypatch):
    from megatron.core import parallel_state

    batches = _batches(megatron_cpu)
    frozen = megatron_rl_patches.build_inference_model(megatron_cpu.provider(seed=13))
    with pytest.raises(ValueError, match="one model chunk, got 2"):
        score_layer_major([frozen[0], frozen[0]], batches)
    trainable = megatron_cpu.gpt(seed=13)
    with pytest.raises(TypeError, match="requires grad"):
        score_layer_major(trainable, batches)
    with pytest.raises(TypeError, match="DDP-wrapped"):
        score_layer_major(megatron_cpu.ddp(trainable), batches)
    head_only = megatron_rl_patches.build_inference_model(
        lambda pre_process=True, post_process=True: megatron_cpu.gpt(pre_process=False))
    with pytest.raises(ValueError, match="pre_process and post_process both True"):
        score_layer_major(head_only, batches)
    # two pipeline stages need two processes: the stage count is what the check reads
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: 2)
    with pytest.raises(ValueError, match="pipeline parallelism 1 only, this job runs 2 pipeline stages"):
        score_layer_major(frozen, batches)


def test_a_model_without_the_processor_hook_is_refused(megatron_cpu_kind, clean_patch_state):
    import inspect

    chunks = megatron_rl_patches.build_inference_model(megatron_cpu_kind.model_provider(seed=14))
    model = chunks[0]  # fp32: the model itself
    if "output_processor" in inspect.signature(model.forward).parameters:
        pytest.skip(f"{type(model).__name__} has the output_processor hook natively here")
    with pytest.raises(TypeError, match="has no output_processor keyword"):
        score_layer_major(chunks, _batches(megatron_cpu_kind), output_processor=log_prob_output_processor())


@pytest.mark.parametrize("prefetch", [0, 1])
def test_stream_build_copies_each_piece_once_per_rollout(megatron_cpu_kind, prefetch):
    from megatron_rl_patches import residency_report
    from megatron_rl_patches.inference.residency.storage import device_weight_bytes

    env = megatron_cpu_kind
    config = env.config(num_layers=3)
    resident = megatron_rl_patches.build_inference_model(env.model_provider(config, seed=15))
    chunks = megatron_rl_patches.build_inference_model(env.model_provider(config, seed=15), residency="stream",
                                                       prefetch=prefetch)
    batches = [{k: v for k, v in batch.items() if k != "labels"} for batch in _batches(env)]
    model = chunks[0]
    pieces = [model.embedding, *model.decoder.layers, model.output_layer]
    largest = max(sum(p.numel() * p.element_size() for p in piece.parameters()) for piece in pieces)
    seen: list[int] = []
    for piece in pieces:  # the device weight bytes whenever a piece starts
        piece.register_forward_pre_hook(lambda module, args: seen.append(device_weight_bytes(model.parameters())))

    stats = ActivationStats()
    got = score_layer_major(chunks, batches, stats=stats)

    _assert_identical(got, _per_micro_batch(resident[0], batches))
    report = residency_report(chunks)
    assert report.copies_by_unit == {"embedding": 1, "layer0": 1, "layer1": 1, "layer2": 1, "head": 1}
    assert device_weight_bytes(model.parameters()) == 0  # nothing left on the device after the rollout
    assert len(seen) == 3 * len(pieces)
    assert max(seen) <= (prefetch + 1) * largest + 64  # + the final norm riding with the head
    assert report.peak_activation_bytes == stats.device_bytes_peak == sum(16 * size * 32 * 4 for size in SIZES)
    assert report.activation_bytes == 0

    copies = report.copies
    _per_micro_batch(chunks[0], batches)  # per micro-batch: every piece once per micro-batch
    assert residency_report(chunks).copies - copies == len(SIZES) * 5


def test_swap_build_comes_in_once_per_rollout(megatron_cpu, clean_patch_state):
    from megatron_rl_patches import residency_report
    from megatron_rl_patches.inference.residency.storage import device_weight_bytes

    megatron_rl_patches.apply(only="gpt_output_processor")
    provider = megatron_cpu.provider(megatron_cpu.config(num_layers=2), seed=16)
    resident = megatron_rl_patches.build_inference_model(provider)
    chunks = megatron_rl_patches.build_inference_model(provider, residency="swap")
    batches = _batches(megatron_cpu)
    processor = log_prob_output_processor(with_entropy=True)
    got = score_layer_major(chunks, batches, output_processor=processor)
    _assert_identical(got, _per_micro_batch(resident[0], batches, output_processor=processor))
    assert residency_report(chunks).copies_by_unit == {"chunk0": 1}
    assert device_weight_bytes(chunks[0].parameters()) == 0


@layouts.mark("bf16")
def test_bf16_float16module_stream_build_with_processor(megatron_cpu, clean_patch_state):
    from megatron_rl_patches import residency_report

    megatron_rl_patches.apply(only="gpt_output_processor")
    config = megatron_cpu.config(num_layers=2, bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    resident = megatron_rl_patches.build_inference_model(megatron_cpu.provider(config, seed=18))
    chunks = megatron_rl_patches.build_inference_model(megatron_cpu.provider(config, seed=18), residency="stream")
    assert type(chunks[0]).__name__ == "Float16Module"
    batches = _batches(megatron_cpu)
    logits_batches = [{k: v for k, v in batch.items() if k != "labels"} for batch in batches]
    got = score_layer_major(chunks, logits_batches, activation_budget=0)
    _assert_identical(got, _per_micro_batch(resident[0], logits_batches))
    assert got[0].dtype == torch.float32  # Float16Module's upcast of the last stage, as per micro-batch
    processor = topk_output_processor(k=4)
    _assert_identical(score_layer_major(chunks, batches, output_processor=processor),
                      _per_micro_batch(resident[0], batches, output_processor=processor))
    assert set(residency_report(chunks).copies_by_unit.values()) == {2}  # two rollouts, one copy each
