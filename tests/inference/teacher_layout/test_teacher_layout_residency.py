"""Swap and stream at a teacher's own layout (the 2-rank world of `layout_worlds.two_rank_world`,
its "residency" part): a teacher at TeacherLayout(tp=2) and at TeacherLayout(pp=2) built with
residency="swap" / "stream" scores each rank's rows bit for bit as the same layout built resident
(log-probs, top-k + tail, hidden states and the gathered output weight) and within one fp32 ulp
of the whole 1-rank teacher; each rank keeps its own shard in host memory (residency_report's
host bytes: half of every split weight at tp=2, only its stage's layers at pp=2) and nothing on the
device between passes; a ResidencyBudget shared by two teachers at layouts never holds more than
its bytes (least recently used evicted), and one too small for a rank's shard is refused on
every rank before the build. On megatron-core 0.13 the layout is refused by name (skipped)."""
from __future__ import annotations

import pytest
import torch

from tests.inference.teacher_layout.layout_worlds import close, served, two_rank_world
from tests.inference.teacher_layout.test_teacher_layout_2rank import _ids, _one_rank_teacher, _refusal, _rows

pytestmark = [pytest.mark.megatron, pytest.mark.multirank, pytest.mark.slow]

MODES = ("swap", "stream")
LAYOUTS = ("tp2", "pp2")


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _expected_shards(whole) -> dict[str, int]:
    """Each rank's own shard bytes, from the whole teacher's parameters: at tp=2 half of every
    split (2-D) weight and every norm whole; at pp=2 stage 0's embedding and first layer, stage
    1's second layer, final norm and output layer."""
    named = dict(whole[0].named_parameters())
    stage0 = ("embedding.", "decoder.layers.0.")
    rank = torch.distributed.get_rank()
    in_stage = [p for name, p in named.items() if name.startswith(stage0) == (rank == 0)]
    return {"tp2": sum(_nbytes([p]) // (2 if p.dim() >= 2 else 1) for p in named.values()),
            "pp2": _nbytes(in_stage), "whole": _nbytes(named.values()),
            "stages": [_nbytes(p for name, p in named.items() if name.startswith(stage0) == first)
                       for first in (True, False)]}


def _scores(chunks, tokens, labels, rank) -> dict:
    from megatron_rl_patches.inference import (
        hidden_at_layout,
        output_weight_at_layout,
        score_at_layout,
        topk_at_layout,
    )

    logp, tail = topk_at_layout(chunks, tokens, _ids(rank))
    return {"scores": score_at_layout(chunks, tokens, labels), "topk": logp, "tail": tail,
            "hidden": hidden_at_layout(chunks, tokens), "weight": output_weight_at_layout(chunks)}


def residency_checks(rank: int, world_size: int, root: str) -> dict:
    import time

    import torch.distributed as dist

    from megatron_rl_patches import ResidencyBudget, build_inference_model_from_hf, residency_report
    from megatron_rl_patches.inference import TeacherLayout, score_at_layout
    from megatron_rl_patches.inference.residency.storage import device_weight_bytes
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    layouts = {"tp2": TeacherLayout(tp=2), "pp2": TeacherLayout(pp=2)}
    tokens, labels = _rows(rank)
    results: dict = {}
    start = time.perf_counter()
    with megatron_on_cpu():  # the student: TP=1 x DP=2

        def build(name: str, **kwargs):
            return build_inference_model_from_hf(root, dtype=torch.float32, layout=layouts[name], **kwargs)

        try:
            resident = {name: build(name) for name in LAYOUTS}
        except ValueError as exc:  # a megatron-core without ProcessGroupCollection
            results["unsupported"] = str(exc)
            dist.barrier()
            return results
        whole = build_inference_model_from_hf(root, dtype=torch.float32)  # the 1-rank teacher, per rank
        results["reference"], results["topk_ref"], results["tail_ref"] = _one_rank_teacher(whole, tokens, labels)
        results["expected"] = _expected_shards(whole)
        for name in LAYOUTS:
            results[name] = {"resident": _scores(resident[name], tokens, labels, rank),
                             "shard": _nbytes(resident[name][0].parameters())}
            for mode in MODES:
                chunks = build(name, residency=mode)
                before = residency_report(chunks)
                scored = _scores(chunks, tokens, labels, rank)
                report = residency_report(chunks)
                results[name][mode] = {**scored, "host_before": before.host_bytes, "host": report.host_bytes,
                                       "mode": report.mode, "device_before": before.device_weight_bytes,
                                       "device_after": device_weight_bytes(chunks[0].parameters()),
                                       "peak": report.peak_device_weight_bytes, "copies": report.copies}
        results["budget"] = _budget_checks(build, results["expected"], tokens, labels, ResidencyBudget,
                                           score_at_layout, device_weight_bytes)
        dist.barrier()  # every rank got here: no refusal above left a rank waiting
    results["seconds"] = time.perf_counter() - start  # what this part adds to the world
    return results


def _budget_checks(build, expected, tokens, labels, budget_class, score, device_bytes) -> dict:
    """Two teachers at layouts (tp=2 and pp=2, both swap) sharing a budget with room for the
    larger shard only (the same on every rank: the largest of the tp=2 shard and both pp=2
    stages): scored in turn twice, the device bytes of both counted before every leaf module
    runs; then a budget smaller than a rank's shard, refused before the build."""
    largest = max(expected["tp2"], *expected["stages"])
    budget = budget_class(largest)
    teachers = [build("tp2", residency="swap", budget=budget), build("pp2", residency="swap", budget=budget)]

    def held() -> int:
        return sum(device_bytes(chunks[0].parameters()) for chunks in teachers)

    seen: list[int] = []
    for chunks in teachers:
        for module in chunks[0].modules():
            if not list(module.children()):
                module.register_forward_pre_hook(lambda *_: seen.append(held()))
    scores = [[score(chunks, tokens, labels) for chunks in teachers] for _step in range(2)]
    small = budget_class(expected["tp2"] // 2)
    return {"bytes": budget.bytes, "peak": budget.peak, "in_use": budget.in_use, "held": held(),
            "evictions": budget.evictions, "seen": max(seen), "scores": scores,
            "last_cached": device_bytes(teachers[1][0].parameters()),
            "too_small": _refusal(lambda: build("tp2", residency="swap", budget=small))}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return two_rank_world(tmp_path_factory, "residency")


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_swap_and_stream_at_a_layout_score_bit_for_bit_as_the_resident_layout(world, name, mode):
    """Log-probs, top-k + tail, hidden states and the gathered output weight: torch.equal to the
    same layout built resident, and the log-probs and top-k within one fp32 ulp of the 1-rank teacher."""
    served(world)
    for rank, result in enumerate(world):
        got, want = result[name][mode], result[name]["resident"]
        assert got["mode"] == mode
        for key in ("scores", "topk", "tail", "hidden", "weight"):
            assert torch.equal(got[key], want[key]), (rank, name, mode, key)
        for key, reference in (("scores", "reference"), ("topk", "topk_ref"), ("tail", "tail_ref")):
            assert close(got[key], result[reference]) <= 1e-6, (rank, name, mode, key)
        assert not torch.equal(got["scores"], torch.zeros_like(got["scores"]))  # a real score, not a placeholder


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_each_rank_keeps_only_its_own_shard_in_host_memory(world, name, mode):
    """residency_report's host bytes are this rank's shard (the resident layout's parameter bytes,
    and the whole teacher's split as the layout splits it), nothing is on the device before or
    after a pass, and each pass copied the shard in (swap: one copy per forward)."""
    served(world)
    for rank, result in enumerate(world):
        figures, expected = result[name][mode], result["expected"]
        print(f"{name} {mode} rank {rank}: host bytes {figures['host']} of the whole teacher's {expected['whole']} "
              f"(this part of the world: {result['seconds']:.1f} s)")
        assert figures["host"] == figures["host_before"] == result[name]["shard"] == expected[name], (rank, name)
        assert figures["host"] < expected["whole"]  # negative control: not the whole teacher
        assert figures["device_before"] == figures["device_after"] == 0, (rank, name, mode)
        assert 0 < figures["peak"] <= figures["host"], (rank, name, mode)
        assert figures["copies"] > 0
    if name == "tp2":
        assert world[0][name][mode]["host"] == world[1][name][mode]["host"]  # two equal halves
    else:
        assert [result[name][mode]["host"] for result in world] == world[0]["expected"]["stages"]


def test_a_budget_shared_by_two_layout_teachers_holds_at_most_its_bytes(world):
    """Two swap teachers at tp=2 and pp=2 under one budget with room for one shard: never more on
    the device than the budget (before every leaf module), the least recently used evicted, the
    last one left cached, scores unchanged from the resident layouts; a budget below a rank's shard
    is refused on every rank before anything loads."""
    served(world)
    for rank, result in enumerate(world):
        budget = result["budget"]
        assert budget["seen"] <= budget["bytes"] and budget["peak"] <= budget["bytes"], (rank, budget["peak"])
        assert budget["in_use"] == budget["held"] == budget["last_cached"] > 0  # the pp=2 teacher stays cached
        assert budget["evictions"] >= 3  # each teacher evicted the other's shard but the first time
        for step in budget["scores"]:
            assert torch.equal(step[0], result["tp2"]["resident"]["scores"])
            assert torch.equal(step[1], result["pp2"]["resident"]["scores"])
        assert "does not fit budget=" in budget["too_small"] and "a rank of layout=" in budget["too_small"]
