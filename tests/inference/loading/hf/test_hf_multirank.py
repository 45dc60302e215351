"""Hugging Face teachers at TP=2 (Qwen3, Qwen2's biases, Qwen3-MoE's experts), PP=2 (every
family; slime_opd's teacher of another size on the actor's split), PP=2xVPP=2 and EP=2 (one
spawned 2-rank gloo world, several worlds of parallel state in turn): log-probs of the logits
route and the fused processor equal transformers' forward to 1e-5 on the ranks that hold them,
for resident builds and (TP=2, PP=2, EP=2) swap and stream builds; sizes that do not divide the
model are refused."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.multirank import run_multirank
from tests.inference import gated_delta_net_ranks

pytestmark = [pytest.mark.megatron, pytest.mark.multirank, pytest.mark.slow]

VOCAB, SEQ = 1001, 12
# deepseek_v3: MLA (issue 51); qwen3_5_moe, qwen3_next: linear attention and gated attention (issue 46)
MOE_FAMILIES = ("glm4_moe", "qwen2_moe", "mixtral", "deepseek_v3", "qwen3_5_moe", "qwen3_next")
# the families and RoPE types of issue 50: a tiny checkpoint each (llama3: Llama 3.1's scaled RoPE); qwen3_5:
# issue 46's dense wrapper (4 layers: stage 0 holds two linear-attention layers, stage 1 one and the full one)
NEW_FAMILIES = (*MOE_FAMILIES, "mimo", "llama3", "qwen3_5")
# one key/value head: at TP=2 megatron-core is built with 2 query groups, the head repeated (kv_heads.py)
KV_REPEATED = ("qwen3_one_kv", "qwen3_5_one_kv")
# the TransformerConfig fields a family needs (0.13.1 lacks them): refused naming the field on a
# megatron-core without one, served on one with all (a refusal there fails the test)
NEEDED_FIELDS = {"qwen2_moe": ("moe_shared_expert_gate",),
                 "qwen3_5": ("attention_output_gate",), "qwen3_5_one_kv": ("attention_output_gate",),
                 "qwen3_5_moe": ("attention_output_gate", "moe_shared_expert_gate"),
                 "qwen3_next": ("attention_output_gate", "moe_shared_expert_gate")}
# at context-parallel size 2 (the kit's attention core; the gated delta nets exchange rows)
CP_FAMILIES = ("dense", "qwen3_5", "qwen3_5_moe", "qwen3_next")


def _scores(chunks, batch, tp_group, microbatches=1):
    """{"logits": [b, s], "fused": [b, s]} through megatron-core's forward-only schedule (empty
    off the last pipeline stage)."""
    from megatron_rl_patches import log_prob_output_processor
    from megatron_rl_patches.inference import inference_forward, token_log_probs

    args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])

    def logits_step(iterator, model):
        next(iterator)
        return model(*args), batch["labels"]

    def fused_step(iterator, model):
        next(iterator)
        out = model(*args, labels=batch["labels"], output_processor=log_prob_output_processor(vocab_size=VOCAB))
        return out["log_probs"] if isinstance(out, dict) else out  # the schedule's MoE path needs a tensor

    def steps():  # the same batch in each micro-batch (virtual stages: an iterator per chunk)
        return [iter([None] * microbatches) for _ in chunks] if len(chunks) > 1 else iter([None] * microbatches)

    options = dict(num_microbatches=microbatches, seq_length=SEQ, micro_batch_size=2)
    routed = inference_forward(chunks, steps(), logits_step,
                               collect=token_log_probs(tp_group=tp_group, vocab_size=VOCAB), **options)
    fused = inference_forward(chunks, steps(), fused_step, collect=lambda out, _: out, **options)
    if not routed:
        return {}
    return {"logits": routed[0]["log_probs"].double(), "fused": fused[0].double()}


def _context_parallel_log_probs(chunks, batch: dict) -> torch.Tensor:
    """Log-probs [b, s] of the labels, each context-parallel rank running its zigzag rows of the
    batch (no attention mask: the core masks causally by global position), gathered back in order."""
    from megatron.core import parallel_state as ps

    from megatron_rl_patches.testing.cp_layout import gather_rows, split_batch

    local = split_batch(batch, "zigzag", ps.get_context_parallel_rank(), ps.get_context_parallel_world_size())
    with torch.no_grad():
        logits = chunks[0](local["tokens"], local["position_ids"], None)
    log_probs = torch.log_softmax(logits[..., :VOCAB].double(), dim=-1)
    return gather_rows(log_probs.gather(-1, local["labels"].unsqueeze(-1)).squeeze(-1), 1, "zigzag")


def _family_scores(path: str, batch: dict, tp_group, reads=None) -> dict | str:
    """`_scores` of the checkpoint at `path`, or the refusal of a family this megatron-core lacks a
    module for (qwen2_moe's gated shared expert, Qwen3.5's gated attention on 0.13.1); `reads`, a
    FileReads, watches the build only (its torch-function mode would break compiled code in the
    forward)."""
    from contextlib import nullcontext

    from megatron_rl_patches import build_inference_model_from_hf
    from megatron_rl_patches.inference.loading.hf import UnsupportedCheckpointError

    try:
        with reads if reads is not None else nullcontext():
            chunks = build_inference_model_from_hf(path, dtype=torch.float32)
    except UnsupportedCheckpointError as exc:
        return str(exc)
    return _scores(chunks, batch, tp_group)


def _lacked_fields(family: str) -> list[str]:
    """The TransformerConfig fields `family` needs that this megatron-core lacks."""
    from dataclasses import fields

    from megatron.core.transformer.transformer_config import TransformerConfig

    known = {f.name for f in fields(TransformerConfig)}
    return [name for name in NEEDED_FIELDS.get(family, ()) if name not in known]


def _refused_as_expected(scores: dict | str, family: str) -> bool:
    """True where this megatron-core lacks a field `family` needs and `scores` is the refusal naming
    one; False where it has them all and `scores` are scores; fails otherwise."""
    lacked = _lacked_fields(family)
    if not lacked:
        assert not isinstance(scores, str), f"{family} refused on a megatron-core that serves it: {scores}"
        return False
    assert isinstance(scores, str), f"{family} built on a megatron-core without {lacked}"
    assert any(f"needs a megatron-core with TransformerConfig.{name}" in scores for name in lacked), scores
    return True


def _new_family_errors(scores: dict | str, family: str, want) -> dict:
    """Errors per route, {} where this megatron-core refuses the family naming what it lacks."""
    if _refused_as_expected(scores, family):
        return {}
    errors = _route_errors(scores, want)
    assert set(errors) == {"logits", "fused"}, errors
    return errors


def _slime_actor(pipeline_size: int):
    """What slime_opd's load_teachers reads of slime's actor (args of the tiny qwen3 actor, its
    model's padded vocab and config, the snapshot switch)."""
    from argparse import Namespace
    from types import SimpleNamespace

    from megatron_rl_patches.integrations.megatron.opd.opd_settings import LOSS_PATH

    args = Namespace(hidden_size=32, num_layers=2, num_attention_heads=4, group_query_attention=True,
                     num_query_groups=2, kv_channels=8, ffn_hidden_size=48, vocab_size=VOCAB, qk_layernorm=True,
                     untie_embeddings_and_output_weights=True, loss_type="custom_loss",
                     custom_loss_function_path=LOSS_PATH, params_dtype=torch.float32, transformer_impl="local",
                     pipeline_model_parallel_size=pipeline_size)
    model = [SimpleNamespace(vocab_size=1024, config=SimpleNamespace(variable_seq_lengths=False))]
    return SimpleNamespace(args=args, model=model, _switch_model=lambda tag: None)


def _worker(rank: int, world_size: int, root: str, batch: dict) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe import moe_utils

    from megatron_rl_patches import apply, build_inference_model_from_hf
    from megatron_rl_patches.inference.loading.hf import UnsupportedCheckpointError
    from megatron_rl_patches.integrations.megatron.opd.opd_settings import TEACHERS, opd_settings
    from megatron_rl_patches.integrations.slime import opd
    from megatron_rl_patches.testing.file_reads import FileReads
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    dense, moe, qwen2 = f"{root}/dense", f"{root}/moe", f"{root}/qwen2"

    if not hasattr(moe_utils, "te_general_gemm"):  # megatron-core < 0.17 without TE: see conftest
        moe_utils.te_general_gemm = None
    apply(only="gpt_output_processor")
    results: dict = {}
    with megatron_on_cpu(tensor_parallel=2):
        with FileReads(dense) as reads:  # which bytes of the files this rank reads (here and below)
            chunks = build_inference_model_from_hf(dense, dtype=torch.float32)
        results["tp2_reads"] = reads.read
        results["tp2_vocab_shard"] = chunks[0].output_layer.weight.shape[0]
        results["tp2"] = _scores(chunks, batch, ps.get_tensor_model_parallel_group())
        results["tp2_stream"] = _scores(build_inference_model_from_hf(dense, residency="stream", dtype=torch.float32),
                                        batch, ps.get_tensor_model_parallel_group())
        # q/k/v biases split with their heads; experts split over the expert tensor-parallel group
        results["tp2_qwen2"] = _scores(build_inference_model_from_hf(qwen2, dtype=torch.float32), batch,
                                       ps.get_tensor_model_parallel_group())
        with FileReads(moe) as reads:
            results["tp2_moe"] = _scores(build_inference_model_from_hf(moe, dtype=torch.float32), batch,
                                         ps.get_tensor_model_parallel_group())
        results["tp2_moe_reads"] = reads.read
        for family in NEW_FAMILIES:  # shared experts, biases and partial RoPE split with their heads / columns
            reads = FileReads(f"{root}/{family}")
            results[f"tp2_{family}"] = _family_scores(f"{root}/{family}", batch,
                                                      ps.get_tensor_model_parallel_group(), reads)
            results[f"tp2_{family}_reads"] = reads.read
        # one key/value head at TP=2, at the student's layout: repeated, a query group per rank (kv_heads.py)
        for name in KV_REPEATED:
            results[f"tp2_{name}"] = _family_scores(f"{root}/{name}", batch, ps.get_tensor_model_parallel_group())
    with megatron_on_cpu(pipeline_parallel=2):
        with FileReads(dense) as reads:
            chunks = build_inference_model_from_hf(dense, dtype=torch.float32)
        results["pp2_reads"] = reads.read
        results["pp2_layers"] = len(chunks[0].decoder.layers)
        results["pp2"] = _scores(chunks, batch, None)
        for residency in ("swap", "stream"):  # each stage moves only its own layers
            results[f"pp2_{residency}"] = _scores(
                build_inference_model_from_hf(dense, residency=residency, dtype=torch.float32), batch, None)
        for family in ("llama", "qwen2", "moe", *NEW_FAMILIES):  # every family, split over the stages (glm4_moe:
            # its dense layer 0 on stage 0, its MoE layer 1 on stage 1)
            results[f"pp2_{family}"] = _family_scores(f"{root}/{family}", batch, None)
        # slime_opd: a PATH teacher of another size than the actor, on the actor's pipeline split
        (chunks,) = opd.load_teachers(_slime_actor(2), opd_settings({TEACHERS: f"{root}/other"}))
        results["pp2_other_layers"] = [layer.layer_number for layer in chunks[0].decoder.layers]
        results["pp2_other"] = _scores(chunks, batch, None)
    with megatron_on_cpu(pipeline_parallel=2, virtual_pipeline=2):  # each chunk its own layers
        chunks = build_inference_model_from_hf(f"{root}/other", dtype=torch.float32)
        results["vpp2_layers"] = [[layer.layer_number for layer in chunk.decoder.layers] for chunk in chunks]
        results["vpp2"] = _scores(chunks, batch, None, microbatches=2)
        try:
            build_inference_model_from_hf(dense)  # 2 layers over 4 virtual stages
            results["vpp2_refused"] = None
        except ValueError as exc:
            results["vpp2_refused"] = str(exc)
    with megatron_on_cpu():
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
        with FileReads(moe) as reads:
            chunks = build_inference_model_from_hf(moe, dtype=torch.float32)
        results["ep2_reads"] = reads.read
        results["ep2_experts"] = len(chunks[0].decoder.layers[0].mlp.experts.local_experts)
        results["ep2"] = _scores(chunks, batch, None)
        for residency in ("swap", "stream"):  # each expert rank moves only its own experts
            results[f"ep2_{residency}"] = _scores(
                build_inference_model_from_hf(moe, residency=residency, dtype=torch.float32), batch, None)
        for family in MOE_FAMILIES:  # the router's expert bias whole on each rank, its experts split
            results[f"ep2_{family}"] = _family_scores(f"{root}/{family}", batch, None)
    with megatron_on_cpu():  # CP=2: the local attention would score each rank's rows alone
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(1, 1, context_parallel_size=2)
        try:
            build_inference_model_from_hf(dense)
            results["cp2_refused"] = None
        except ValueError as exc:
            results["cp2_refused"] = str(exc)
        # served with an attention core that serves context parallelism (Transformer Engine's on a GPU,
        # the kit's here); the gated delta nets exchange rows over the context-parallel group
        from megatron_rl_patches.testing.cp_attention import ContextParallelAttention

        for family in CP_FAMILIES:
            path = dense if family == "dense" else f"{root}/{family}"
            try:
                chunks = build_inference_model_from_hf(path, core_attention=ContextParallelAttention,
                                                       dtype=torch.float32)
            except UnsupportedCheckpointError as exc:  # a megatron-core without the family's modules
                results[f"cp2_{family}"] = str(exc)
                continue
            results[f"cp2_{family}"] = _context_parallel_log_probs(chunks, batch)
        results["cp2_gated_delta_net"] = gated_delta_net_ranks.context_parallel_errors()
    with megatron_on_cpu(tensor_parallel=2):  # sequence parallelism in the gated delta net
        results["tp2_sp_gated_delta_net"] = gated_delta_net_ranks.sequence_parallel_error()
    with megatron_on_cpu(pipeline_parallel=2):
        try:
            build_inference_model_from_hf(dense + "_3layers")
            results["refused"] = None
        except ValueError as exc:
            results["refused"] = str(exc)
    return results


@pytest.fixture(scope="module")
def world(transformers, tmp_path_factory):
    from megatron_rl_patches.testing.hf_checkpoints import (
        router_margin,
        save_tiny_hf,
        save_tiny_mimo,
        tiny_hf_config,
        write_tiny_checkpoint,
    )
    from megatron_rl_patches.testing.megatron_cpu import make_batch

    root = tmp_path_factory.mktemp("hf")
    models = {"dense": save_tiny_hf(root / "dense", "qwen3", seed=7),
              "moe": save_tiny_hf(root / "moe", "qwen3_moe", seed=8),
              "qwen2": save_tiny_hf(root / "qwen2", "qwen2", seed=9),
              "llama": save_tiny_hf(root / "llama", "llama", seed=10),
              "other": save_tiny_hf(root / "other", "qwen3", seed=11, hidden_size=48, num_hidden_layers=4,
                                    intermediate_size=64),
              "glm4_moe": save_tiny_hf(root / "glm4_moe", "glm4_moe", seed=4),
              "qwen2_moe": save_tiny_hf(root / "qwen2_moe", "qwen2_moe", seed=5),
              "mixtral": save_tiny_hf(root / "mixtral", "mixtral", seed=3),
              "deepseek_v3": save_tiny_hf(root / "deepseek_v3", "deepseek_v3", seed=6, rope_interleave=False),
              "mimo": save_tiny_mimo(root / "mimo", seed=12),
              "llama3": save_tiny_hf(root / "llama3", "llama", seed=13, rope_parameters={
                  "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
              "qwen3_5": save_tiny_hf(root / "qwen3_5", "qwen3_5", seed=2),
              "qwen3_5_moe": save_tiny_hf(root / "qwen3_5_moe", "qwen3_5_moe", seed=3),
              "qwen3_next": save_tiny_hf(root / "qwen3_next", "qwen3_next", seed=3),
              "qwen3_one_kv": save_tiny_hf(root / "qwen3_one_kv", "qwen3", seed=14, num_key_value_heads=1),
              "qwen3_5_one_kv": save_tiny_hf(root / "qwen3_5_one_kv", "qwen3_5", seed=15, num_key_value_heads=1)}
    write_tiny_checkpoint(root / "dense_3layers", tiny_hf_config("qwen3", num_hidden_layers=3))
    batch = make_batch(batch_size=2, seq_length=SEQ, vocab_size=VOCAB, seed=4)
    for name in (*MOE_FAMILIES, "moe"):  # seeds whose routing decisions are all more than 1e-3 from a tie
        assert router_margin(models[name], batch["tokens"]) > 1e-3, name
    reference = {}
    for name, model in models.items():
        with torch.no_grad():
            full = torch.log_softmax(model(batch["tokens"]).logits.double(), dim=-1)
        reference[name] = full.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
    results = run_multirank(_worker, 2, str(root), batch, timeout=600)
    return results, reference


def _route_errors(scores, want):
    return {route: (got - want).abs().max().item() for route, got in scores.items()}


@layouts.mark("tp2")
def test_tp2_equals_transformers_on_every_rank(world):
    results, reference = world
    for result in results:
        assert result["tp2_vocab_shard"] == 512  # 1001 ids padded to 1024, half per rank
        for key in ("tp2", "tp2_stream"):
            assert set(result[key]) == {"logits", "fused"}
            assert all(err < 1e-5 for err in _route_errors(result[key], reference["dense"]).values()), key


@pytest.mark.parametrize("name", KV_REPEATED)
def test_tp2_beyond_the_key_value_heads_repeats_them_and_equals_transformers(world, name):
    """One key/value head at the student's TP=2 (it was refused): each rank holds half the query
    heads and the whole key/value head; the log-probs are transformers' (Qwen3.5's gated attention
    refused by name where megatron-core lacks it: 0.13.1)."""
    results, reference = world
    for result in results:
        if _refused_as_expected(result[f"tp2_{name}"], name):
            continue
        errors = _route_errors(result[f"tp2_{name}"], reference[name])
        bound = 1e-4 if name == "qwen3_5_one_kv" else 1e-5  # as the family's own at TP=2 (its 4 layers drift)
        assert set(errors) == {"logits", "fused"} and all(err < bound for err in errors.values()), (name, errors)


def test_tp2_qwen2_biases_and_moe_experts_equal_transformers(world):
    results, reference = world
    for result in results:
        for key, model in (("tp2_qwen2", "qwen2"), ("tp2_moe", "moe")):
            errors = _route_errors(result[key], reference[model])
            assert set(errors) == {"logits", "fused"} and all(err < 1e-5 for err in errors.values()), (key, errors)


@layouts.mark("pp2")
@pytest.mark.parametrize("residency", ["resident", "swap", "stream"])
def test_pp2_equals_transformers_on_the_last_stage(world, residency):
    results, reference = world
    key = "pp2" if residency == "resident" else f"pp2_{residency}"
    assert [r["pp2_layers"] for r in results] == [1, 1]
    assert results[0][key] == {}
    errors = _route_errors(results[1][key], reference["dense"])
    assert set(errors) == {"logits", "fused"} and all(err < 1e-5 for err in errors.values()), errors


@layouts.mark("pp2")
@pytest.mark.parametrize("family", ["llama", "qwen2", "moe"])
def test_pp2_every_family_equals_transformers_on_the_last_stage(world, family):
    results, reference = world
    assert results[0][f"pp2_{family}"] == {}
    errors = _route_errors(results[1][f"pp2_{family}"], reference[family])
    assert set(errors) == {"logits", "fused"} and all(err < 1e-5 for err in errors.values()), errors


@layouts.mark("pp2")
def test_slime_opd_teacher_of_another_size_takes_the_actors_pipeline_split(world):
    """4 layers over the actor's 2 stages (the actor has 2): layers 1-2 and 3-4, the last stage's
    log-probs those of transformers."""
    results, reference = world
    assert [r["pp2_other_layers"] for r in results] == [[1, 2], [3, 4]]
    assert results[0]["pp2_other"] == {}
    errors = _route_errors(results[1]["pp2_other"], reference["other"])
    assert set(errors) == {"logits", "fused"} and all(err < 1e-5 for err in errors.values()), errors


@layouts.mark("pp2", "vpp2")
def test_pp2_vpp2_chunks_take_their_own_layers(world):
    """Before the fix every virtual chunk of a stage built that stage's first layers ([1, 2] twice
    on stage 0): the TransformerConfig had no virtual pipeline size."""
    results, reference = world
    assert [r["vpp2_layers"] for r in results] == [[[1], [3]], [[2], [4]]]
    assert results[0]["vpp2"] == {}
    errors = _route_errors(results[1]["vpp2"], reference["other"])
    assert set(errors) == {"logits", "fused"} and all(err < 1e-5 for err in errors.values()), errors


@layouts.mark("ep2")
@pytest.mark.parametrize("residency", ["resident", "swap", "stream"])
def test_ep2_moe_equals_transformers(world, residency):
    results, reference = world
    key = "ep2" if residency == "resident" else f"ep2_{residency}"
    assert [r["ep2_experts"] for r in results] == [2, 2]  # 4 experts, 2 per rank
    for result in results:
        errors = _route_errors(result[key], reference["moe"])
        assert set(errors) == {"logits", "fused"} and all(err < 1e-5 for err in errors.values()), errors


def test_sizes_that_do_not_divide_the_model_are_refused(world):
    results, _ = world
    for result in results:
        assert "num_hidden_layers=3 is not a multiple of the pipeline-parallel size 2" in result["refused"]
        assert "num_hidden_layers=2 is not a multiple of the pipeline-parallel size 2 x 2 virtual stages" in \
            result["vpp2_refused"]


@layouts.mark("cp2-zigzag")
def test_context_parallelism_with_the_local_attention_is_refused(world):
    """The weights do not depend on CP, but megatron-core's local attention would attend within each
    rank's rows only: a CP=2 build without a CP-serving core_attention is refused before any weight loads."""
    results, _ = world
    for result in results:
        assert result["cp2_refused"] is not None and "context-parallel size 2" in result["cp2_refused"]
        assert "core_attention=" in result["cp2_refused"]


@layouts.mark("cp2-zigzag")
@pytest.mark.parametrize("family", CP_FAMILIES)
def test_cp2_teachers_equal_transformers_gated_delta_nets_included(world, family):
    """Qwen3.5, Qwen3.5-MoE and Qwen3-Next (gated delta nets, then a gated full-attention layer) and a
    dense Qwen3 at context-parallel size 2, each rank holding its zigzag rows: the gathered
    log-probs equal transformers' forward on whole sequences."""
    results, reference = world
    name = "dense" if family == "dense" else family
    for result in results:
        got = result[f"cp2_{family}"]
        if _refused_as_expected(got, family):  # megatron-core 0.13.1 lacks Qwen3.5's gated attention
            continue
        assert (got - reference[name]).abs().max().item() < 1e-4


def test_the_gated_delta_net_at_cp2_equals_it_on_whole_sequences(world):
    """Context parallelism in the layer: heads split over the ranks (2 key heads) and every head on
    each (1), zigzag and contiguous rows, unpacked and packed, each rank's rows equal the layer
    over whole sequences; run without the exchange, a rank's rows are far off (the control)."""
    results, _ = world
    for result in results:
        errors = result["cp2_gated_delta_net"]
        assert len(errors) == 9, errors
        control = errors.pop("no exchange")
        assert all(err < 1e-5 for err in errors.values()), errors
        assert control > 1e-2, control


def test_the_gated_delta_net_with_sequence_parallelism_equals_it_without(world):
    results, _ = world
    assert all(result["tp2_sp_gated_delta_net"] < 1e-5 for result in results)


@layouts.mark("tp2")
@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_tp2_new_families_equal_transformers(world, family):
    results, reference = world
    for result in results:
        errors = _new_family_errors(result[f"tp2_{family}"], family, reference[family])
        assert all(err < 1e-4 for err in errors.values()), errors


@layouts.mark("pp2")
@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_pp2_new_families_equal_transformers_on_the_last_stage(world, family):
    results, reference = world
    assert results[0][f"pp2_{family}"] in ({}, results[1][f"pp2_{family}"])  # nothing off the last stage, or refused
    errors = _new_family_errors(results[1][f"pp2_{family}"], family, reference[family])
    assert all(err < 1e-4 for err in errors.values()), errors


@layouts.mark("ep2")
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_ep2_new_moe_families_equal_transformers(world, family):
    results, reference = world
    for result in results:
        errors = _new_family_errors(result[f"ep2_{family}"], family, reference[family])
        assert all(err < 1e-4 for err in errors.values()), errors



# whole on every rank: norms, routers (their expert bias too) and qwen2_moe's shared-expert gate
REPLICATED = ("norm.weight", "gate.weight", "e_score_correction_bias")


def _reads(results, key):
    """Each rank's bytes read from the checkpoint's files in the build `key`: name -> flags."""
    return [result[key] for result in results]


@layouts.mark("tp2")
@pytest.mark.parametrize("model", ["dense", "moe", *NEW_FAMILIES])
def test_tp2_each_rank_reads_only_its_part_of_a_split_tensor(world, model):
    """A split tensor's bytes are read about half by each rank, the halves disjoint and together
    whole; a replicated one whole by both. Before the fix MLA's q_b_proj and kv_a_proj_with_mqa
    were read whole on each rank (their rotary rows reordered before the split)."""
    results, _ = world
    if model != "dense" and _refused_as_expected(results[0][f"tp2_{model}"], model):
        pytest.skip(results[0][f"tp2_{model}"])  # refused on this megatron-core
    first, second = _reads(results, "tp2_reads" if model == "dense" else f"tp2_{model}_reads")
    assert first and set(first) == set(second), sorted(set(first) ^ set(second))
    split = 0
    for name, mine in first.items():
        theirs = second[name]
        if name.endswith(REPLICATED):
            assert mine.all() and theirs.all(), name
            continue
        split += 1
        assert not (mine & theirs).any() and (mine | theirs).all(), name  # each byte read by one rank
        assert 0.45 < mine.mean() < 0.55, (name, mine.mean())  # about half (the vocab: 512 of 1001 rows)
    assert split >= 10  # positive control: the projections and the embedding are split


@layouts.mark("pp2")
def test_pp2_each_stage_reads_only_its_own_layers(world):
    """Stage 0 reads the embedding and layer 0, stage 1 layer 1, the final norm and the output
    layer: each tensor whole, none of the other stage's."""
    results, _ = world
    first, second = _reads(results, "pp2_reads")
    assert all(flags.all() for flags in (*first.values(), *second.values()))
    assert not set(first) & set(second), sorted(set(first) & set(second))
    assert "model.embed_tokens.weight" in first and {"model.norm.weight", "lm_head.weight"} <= set(second)
    assert {name.split(".")[2] for name in first if name.startswith("model.layers.")} == {"0"}
    assert {name.split(".")[2] for name in second if name.startswith("model.layers.")} == {"1"}
    assert len(first) + len(second) == 25  # every tensor of the checkpoint, by one stage


@layouts.mark("ep2")
def test_ep2_each_rank_reads_only_its_own_experts(world):
    """Rank 0 reads experts 0-1 of each layer, rank 1 experts 2-3; the rest (attention, router,
    norms, embedding, output layer) whole on both."""
    results, _ = world
    for rank, reads in enumerate(_reads(results, "ep2_reads")):
        assert all(flags.all() for flags in reads.values())
        experts = {int(name.split(".")[5]) for name in reads if ".mlp.experts." in name}
        assert experts == {2 * rank, 2 * rank + 1}, (rank, experts)
        assert len([name for name in reads if ".mlp.experts." in name]) == 2 * 2 * 3  # 2 layers, 2 experts, 3 each
        assert "model.layers.1.mlp.gate.weight" in reads and "lm_head.weight" in reads
