"""Families beyond a dense Llama at a teacher's own layout, in the 2-rank world the other
teacher-layout checks share (`layout_worlds.two_rank_world`, spawned once): a tiny mixture of
experts (`qwen3_moe`: experts split over the teacher's tensor-parallel group), multi-latent
attention with experts, shared experts and group-limited routing (`deepseek_v3`: megatron-core's MLA
gathers its down projections in parallel_state's group, which a layout turns to its own), and
gated-delta-net linear attention (`qwen3_5`; `qwen3_next` with experts and a gated shared expert:
the layer's heads split over the model's pg_collection). At TeacherLayout(tp=2) beside a DP=2
student each rank's rows get the whole teacher's log-probs (1e-6, relative 1e-6) and top-k
log-probs and tail, and each rank holds half of every split weight. A tiny qwen3 and a tiny qwen3_5
with one key/value head at tp=2: the head repeated (kv_heads.py), each rank holds half the queries and
the whole head, to the same log-probs. At TeacherLayout(pp=2) (rank 0 the first stage, rank 1 the
last) the families give the same, each stage building its own layer's kinds (DeepSeek-V3's dense
first layer, then its experts; Qwen3.5's linear-attention layer, then its full attention) and
reading its own layer's tensors only (DeepSeek-V3's stored MTP layer on neither). On a megatron-core
without ProcessGroupCollection (0.13.1) each family is refused by that name before anything loads."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.inference.teacher_layout.layout_worlds import close, served, two_rank_world
from tests.inference.teacher_layout.test_teacher_layout_2rank import ROWS, _ids, _one_rank_teacher, _refusal, _rows

pytestmark = [pytest.mark.megatron, pytest.mark.multirank, pytest.mark.slow]

# two layers each (one linear-attention and one full-attention layer for the hybrids): every layer
# kind once, and rounding that compounds little (four hybrid layers drift to ~3e-5 between splits)
HYBRID = {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]}
FAMILIES = {"qwen3_moe": {}, "deepseek_v3": {}, "qwen3_5": HYBRID, "qwen3_next": HYBRID}
# one key/value head at tp=2: megatron-core built with 2 query groups, the head repeated (kv_heads.py)
KV_REPEATED = {"qwen3_one_kv_head": ("qwen3", {"num_key_value_heads": 1}),
               "qwen3_5_one_kv_head": ("qwen3_5", {**HYBRID, "num_key_value_heads": 1})}
SERVED = [*FAMILIES, *KV_REPEATED]
# what a tensor-parallel split leaves whole on every rank: norms, routers, the shared expert's gate
REPLICATED = re.compile(r"(norm\.weight|router\.weight|gate_weight)$")
# the weights a wrong split would leave whole: experts, MLA's down projections, the gated delta net's
MUST_SPLIT = {"qwen3_moe": ("experts.local_experts.0.linear_fc1.weight", "experts.local_experts.3.linear_fc2.weight"),
              "deepseek_v3": ("linear_kv_down_proj.weight", "linear_q_down_proj.weight", "linear_kv_up_proj.weight",
                              "shared_experts.linear_fc1.weight", "experts.local_experts.7.linear_fc2.weight"),
              "qwen3_5": ("self_attention.in_proj.weight", "self_attention.conv1d.weight", "self_attention.A_log",
                          "self_attention.dt_bias", "self_attention.out_proj.weight"),
              "qwen3_next": ("self_attention.in_proj.weight", "self_attention.A_log",
                             "shared_experts.linear_fc2.weight", "experts.local_experts.1.linear_fc1.weight")}


def _write_checkpoints(rank: int, root: str) -> dict[str, str]:
    """Each family's tiny checkpoint beside the world's qwen3 one, written by rank 0."""
    import torch.distributed as dist

    from megatron_rl_patches.testing.hf_checkpoints import add_mtp_tensors, tiny_hf_config, write_tiny_checkpoint

    paths = {kind: str(Path(root).parent / kind) for kind in (*SERVED, "three_kv_heads")}
    configs = {**{kind: (kind, overrides) for kind, overrides in FAMILIES.items()}, **KV_REPEATED,
               "three_kv_heads": ("qwen3", {"num_attention_heads": 6, "num_key_value_heads": 3})}
    if rank == 0:
        for seed, (kind, (family, overrides)) in enumerate(configs.items()):
            write_tiny_checkpoint(paths[kind], tiny_hf_config(family, **overrides), seed=seed)
        # the multi-token prediction layer a real DeepSeek-V3 stores after its decoder layers: skipped
        add_mtp_tensors(paths["deepseek_v3"], "model.layers.2.", num_nextn_predict_layers=1)
    dist.barrier()
    return paths


def _shapes(chunks) -> dict[str, tuple[int, ...]]:
    return {name: tuple(param.shape) for name, param in chunks[0].named_parameters()}


def _kinds(chunks) -> list[str]:
    """Each decoder layer's mixer and MLP classes, in order (e.g. 'GatedDeltaNetLayer/MLP')."""
    return [f"{type(layer.self_attention).__name__}/{type(layer.mlp).__name__}" for layer in chunks[0].decoder.layers]


def _pipelined(path: str, tokens: torch.Tensor, labels: torch.Tensor, rank: int) -> dict:
    """The family at TeacherLayout(pp=2): each rank's log-probs, top-k log-probs and tail, its
    layers' numbers and kinds, and the decoder layers whose tensors it read."""
    from megatron_rl_patches import build_inference_model_from_hf
    from megatron_rl_patches.inference import TeacherLayout, score_at_layout, topk_at_layout
    from megatron_rl_patches.testing.file_reads import FileReads

    with FileReads(path) as reads:
        chunks = build_inference_model_from_hf(path, dtype=torch.float32, layout=TeacherLayout(pp=2))
    layers = {int(match.group(1)) for name in reads.read if (match := re.search(r"layers\.(\d+)\.", name))}
    topk, tail = topk_at_layout(chunks, tokens, _ids(rank))
    return {"pp2_scores": score_at_layout(chunks, tokens, labels), "pp2_topk": topk, "pp2_tail": tail,
            "pp2_layers": [int(layer.layer_number) for layer in chunks[0].decoder.layers],
            "pp2_kinds": _kinds(chunks), "pp2_read_layers": sorted(layers)}


def _load_fails_on_one_rank(path: str, rank: int) -> str:
    """The error of a TeacherLayout(pp=2) build whose weights fail to load on rank 1 only: every
    rank raises (none goes on to wait for the other stage in scoring)."""
    import contextlib
    from unittest import mock

    from megatron_rl_patches import build_inference_model_from_hf
    from megatron_rl_patches.inference import TeacherLayout

    def boom(*args, **kwargs):
        raise OSError("this rank's weights failed to load on purpose")

    target = "megatron_rl_patches.inference.loading.hf.load.load_hf_weights"
    with mock.patch(target, boom) if rank == 1 else contextlib.nullcontext():
        try:
            build_inference_model_from_hf(path, dtype=torch.float32, layout=TeacherLayout(pp=2))
        except (OSError, RuntimeError) as exc:
            return f"{type(exc).__name__}: {exc}"
    return "built"


def family_checks(rank: int, world_size: int, root: str) -> dict:
    """Per family: the TP=2 teacher's scores and top-k of this rank's rows, the whole teacher's
    (built in the student's TP=1 groups on this rank), and the parameter shapes of both."""
    import time

    from megatron_rl_patches import build_inference_model_from_hf
    from megatron_rl_patches.inference import TeacherLayout, score_at_layout, topk_at_layout
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    start = time.perf_counter()
    paths = _write_checkpoints(rank, root)
    tokens, labels = _rows(rank)
    layout = TeacherLayout(tp=2)
    results: dict = {}
    with megatron_on_cpu():
        # 3 key/value heads at tp=2: neither divided (tp does not divide them) nor repeated (nor tp they)
        results["three_kv_heads"] = _refusal(lambda: build_inference_model_from_hf(paths.pop("three_kv_heads"),
                                                                                   layout=layout))
        # megatron-core compiles the gated attention's output gate with torch.compile on its first
        # call (~10 s a rank on CPU): the same eager function runs in both teachers here
        with torch._dynamo.config.patch(disable=True):
            for kind, path in paths.items():
                try:
                    chunks = build_inference_model_from_hf(path, dtype=torch.float32, layout=layout)
                except ValueError as exc:  # a megatron-core without ProcessGroupCollection; anything else fails
                    if "needs megatron-core's ProcessGroupCollection" not in str(exc):
                        raise
                    results[kind] = {"unsupported": str(exc)}
                    continue
                whole = build_inference_model_from_hf(path, dtype=torch.float32)
                reference, topk_ref, tail_ref = _one_rank_teacher(whole, tokens, labels)
                topk, tail = topk_at_layout(chunks, tokens, _ids(rank))
                results[kind] = {"scores": score_at_layout(chunks, tokens, labels), "reference": reference,
                                 "topk": topk, "topk_ref": topk_ref, "tail": tail, "tail_ref": tail_ref,
                                 "held": _shapes(chunks), "whole": _shapes(whole), "whole_kinds": _kinds(whole)}
            results["tp2_seconds"] = time.perf_counter() - start
            for kind in FAMILIES:  # a teacher pipeline: rank 0 the first stage, rank 1 the last
                if "scores" in results[kind]:
                    results[kind].update(_pipelined(paths[kind], tokens, labels, rank))
            if "scores" in results["qwen3_moe"]:
                results["load_fails"] = _load_fails_on_one_rank(paths["qwen3_moe"], rank)
    results["seconds"] = time.perf_counter() - start  # what the families add to the world
    return results


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return two_rank_world(tmp_path_factory, "families")


@pytest.fixture(params=SERVED)
def family(request, world):
    """Each rank's results of one family (skipped where the layout is refused: megatron-core 0.13)."""
    results = [result[request.param] for result in world]
    served(results)
    return request.param, results


def test_each_family_at_tp2_gives_each_rank_the_whole_teachers_log_probs(family):
    kind, results = family
    for rank, result in enumerate(results):
        assert result["scores"].shape == ROWS[rank]
        assert close(result["scores"], result["reference"]) <= 1e-6, (kind, rank)


def test_each_family_at_tp2_gives_each_rank_the_whole_teachers_topk_log_probs_and_tail(family):
    kind, results = family
    for rank, result in enumerate(results):
        assert result["topk"].shape == (*ROWS[rank], 4) and result["tail"].shape == ROWS[rank]
        for key in ("topk", "tail"):
            assert close(result[key], result[f"{key}_ref"]) <= 1e-6, (kind, rank, key)


def test_each_rank_holds_half_of_each_familys_split_weights(family):
    kind, results = family
    if kind in KV_REPEATED:
        pytest.skip("the repeated key/value head is whole on each rank: test_a_key_value_head_tp_exceeds_is_repeated")
    for result in results:
        held, whole = result["held"], result["whole"]
        assert held.keys() == whole.keys()
        halved = set()
        for name, shape in held.items():
            if shape == whole[name]:
                assert REPLICATED.search(name), f"{kind}: {name} {shape} is whole on a TP=2 rank"
                continue
            split = [i for i, (a, b) in enumerate(zip(shape, whole[name])) if a != b]
            assert len(split) == 1 and 2 * shape[split[0]] == whole[name][split[0]], (kind, name, shape, whole[name])
            halved.add(name)
        for suffix in MUST_SPLIT[kind]:
            assert any(name.endswith(suffix) for name in halved), (kind, suffix)
        share = sum(torch.Size(s).numel() for s in held.values()) / sum(torch.Size(s).numel() for s in whole.values())
        assert 0.5 <= share < 0.53, (kind, share)


def test_each_family_at_pp2_gives_each_rank_the_whole_teachers_log_probs_and_topk(family):
    kind, results = family
    if kind in KV_REPEATED:
        pytest.skip("a teacher pipeline is checked on the families; a repeated key/value head is a tp=2 matter")
    for rank, result in enumerate(results):
        assert result["pp2_layers"] == [rank + 1], (kind, rank)  # layer 1 on the first stage, layer 2 on the last
        for key, want in (("pp2_scores", "reference"), ("pp2_topk", "topk_ref"), ("pp2_tail", "tail_ref")):
            assert result[key].shape == result[want].shape, (kind, rank, key)
            assert close(result[key], result[want]) <= 1e-6, (kind, rank, key, close(result[key], result[want]))


def test_each_pipeline_stage_builds_and_reads_its_own_layers_kinds_only(family):
    kind, results = family
    if kind in KV_REPEATED:
        pytest.skip("a teacher pipeline is checked on the families; a repeated key/value head is a tp=2 matter")
    whole = results[0]["whole_kinds"]
    if kind in ("deepseek_v3", "qwen3_5", "qwen3_next"):  # layers of two kinds: a stage built as the other fails
        assert whole[0] != whole[1], (kind, whole)
    for rank, result in enumerate(results):
        assert result["pp2_kinds"] == [whole[rank]], (kind, rank, result["pp2_kinds"], whole)
        assert result["pp2_read_layers"] == [rank], (kind, rank)  # DeepSeek-V3's MTP layer 2: on neither stage


def test_a_build_that_fails_on_one_rank_raises_on_every_rank(world):
    if "load_fails" not in world[0]:
        pytest.skip("this megatron-core refuses a teacher layout")
    assert world[0]["load_fails"] == world[1]["load_fails"]  # the same error on every rank
    assert world[1]["load_fails"].startswith("OSError: this rank's weights failed to load on purpose")
    assert "refused on rank(s) [1] of the default process group [0, 1]" in world[0]["load_fails"]


def test_each_family_is_refused_by_name_where_megatron_core_lacks_process_group_collections(world):
    print(f"the families' checks took {[round(result['seconds'], 1) for result in world]} s per rank, of which "
          f"pp=2 {[round(result['seconds'] - result.get('tp2_seconds', 0), 1) for result in world]}")
    for result in world:
        for kind in FAMILIES:
            if "unsupported" in result[kind]:  # 0.13.1: before the family's own checks or any read
                assert "needs megatron-core's ProcessGroupCollection" in result[kind]["unsupported"], kind
            else:
                assert "scores" in result[kind], kind


@pytest.mark.parametrize("kind", list(KV_REPEATED))
def test_a_key_value_head_tp_exceeds_is_repeated_each_rank_holding_half_the_queries(world, kind):
    """One key/value head at tp=2: each rank's linear_qkv holds half the query heads (and their
    output gates, qwen3_5) and the whole key and value head; everything else split as usual."""
    results = [result[kind] for result in world]
    served(results)
    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config

    family, overrides = KV_REPEATED[kind]
    head = tiny_hf_config(family, **overrides)["head_dim"]
    for result in results:
        held, whole = result["held"], result["whole"]
        assert held.keys() == whole.keys()
        qkv = [name for name in held if name.endswith("linear_qkv.weight")]
        assert qkv, kind
        for name in qkv:
            rows, columns = whole[name]
            assert held[name] == ((rows - 2 * head) // 2 + 2 * head, columns), (kind, name, held[name], whole[name])


def test_a_tp_the_key_value_heads_do_not_divide_is_refused_naming_the_tps_served(world):
    for result in world:
        if "unsupported" in result["qwen3_moe"]:
            assert "needs megatron-core's ProcessGroupCollection" in result["three_kv_heads"]
            continue
        assert "num_key_value_heads=3 is not a multiple of the tensor-parallel size 2" in result["three_kv_heads"]
        assert result["three_kv_heads"].endswith("(over 2 ranks: tp in [1])")
