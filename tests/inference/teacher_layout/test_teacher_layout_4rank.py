"""A teacher at its own layout over 4 student ranks (one spawned 4-rank gloo world, the student at
TP=1 x DP=4): TeacherLayout(tp=4) (one group of 4) and TeacherLayout(tp=2) (teacher TP=2 x DP=2,
groups {0, 1} and {2, 3}) built side by side; each rank's rows (counts and lengths differ per
rank, rank 2 has none) scored to the whole teacher's log-probs on that rank (1e-6, relative
1e-6), each rank holding 1/tp of the vocab; the same beside a student at TP=2 x DP=2 (teacher TP=4
and TP=1: the student's parallel_state plays no part); a tiny deepseek_v3 (multi-latent attention
with experts) at TeacherLayout(tp=4), each expert a quarter per rank."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rl_patches.testing.multirank import run_multirank

pytestmark = [pytest.mark.megatron, pytest.mark.multirank, pytest.mark.slow]

VOCAB = 1001
ROWS = ((2, 5), (1, 9), (0, 0), (3, 4))  # (count, length) per rank


def _rows(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    count, length = ROWS[rank]
    gen = torch.Generator().manual_seed(200 + rank)
    ids = torch.randint(0, VOCAB, (count, length + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _worker(rank: int, world_size: int, root: str) -> dict:
    import time

    from megatron.core import package_info

    from megatron_rl_patches import build_inference_model_from_hf
    from megatron_rl_patches.inference import TeacherLayout, score_at_layout, teacher_groups
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    results: dict = {"version": package_info.__version__}
    tokens, labels = _rows(rank)
    with megatron_on_cpu():  # the student: TP=1 x DP=4
        try:
            whole = build_inference_model_from_hf(root, dtype=torch.float32, layout=TeacherLayout(tp=1))
        except ValueError as exc:  # a megatron-core without ProcessGroupCollection
            results["unsupported"] = str(exc)
            return results
        results["reference"] = score_at_layout(whole, tokens, labels)  # one rank per teacher group: no gather
        for tp in (4, 2):
            chunks = build_inference_model_from_hf(root, dtype=torch.float32, layout=TeacherLayout(tp=tp))
            groups = teacher_groups(TeacherLayout(tp=tp))
            results[f"tp{tp}_ranks"] = groups.tp_ranks()
            results[f"tp{tp}_dp"] = (groups.dp_rank, groups.dp_size)
            results[f"tp{tp}_vocab"] = chunks[0].embedding.word_embeddings.weight.shape[0]
            results[f"tp{tp}"] = score_at_layout(chunks, tokens, labels)
    with megatron_on_cpu(tensor_parallel=2):  # a student at TP=2 x DP=2: the teacher's layout ignores it
        chunks = build_inference_model_from_hf(root, dtype=torch.float32, layout=TeacherLayout(tp=4))
        results["student_tp2_teacher_tp4"] = score_at_layout(chunks, tokens, labels)
        chunks = build_inference_model_from_hf(root, dtype=torch.float32, layout=TeacherLayout(tp=1))
        results["student_tp2_teacher_tp1_vocab"] = chunks[0].embedding.word_embeddings.weight.shape[0]
        results["student_tp2_teacher_tp1"] = score_at_layout(chunks, tokens, labels)
    start = time.perf_counter()
    with megatron_on_cpu():  # multi-latent attention with experts over one teacher group of 4
        mla = str(Path(root).parent / "deepseek_v3")
        whole = build_inference_model_from_hf(mla, dtype=torch.float32, layout=TeacherLayout(tp=1))
        results["mla_reference"] = score_at_layout(whole, tokens, labels)
        chunks = build_inference_model_from_hf(mla, dtype=torch.float32, layout=TeacherLayout(tp=4))
        results["mla_tp4"] = score_at_layout(chunks, tokens, labels)
        results["mla_experts_fc1"] = chunks[0].decoder.layers[1].mlp.experts.local_experts[0].linear_fc1.weight.shape
    results["mla_seconds"] = time.perf_counter() - start
    return results


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint

    root = tmp_path_factory.mktemp("teacher_layout4") / "qwen3"  # 4 key/value heads: TP=4 splits them
    write_tiny_checkpoint(root, tiny_hf_config("qwen3", num_key_value_heads=4), seed=5)
    write_tiny_checkpoint(root.parent / "deepseek_v3", tiny_hf_config("deepseek_v3"), seed=6)
    return run_multirank(_worker, 4, str(root), timeout=600)


def test_teacher_tp4_and_tp2_x_dp2_give_each_rank_the_whole_teachers_log_probs(world):
    if "unsupported" in world[0]:
        pytest.skip(f"this megatron-core refuses a teacher layout: {world[0]['unsupported']}")
    print(f"deepseek_v3 at tp=4 took {[round(result['mla_seconds'], 1) for result in world]} s per rank")
    for rank, result in enumerate(world):
        reference = result["reference"]
        assert reference.shape == ROWS[rank]
        assert result["tp4_ranks"] == [0, 1, 2, 3] and result["tp4_dp"] == (0, 1)
        assert result["tp2_ranks"] == [2 * (rank // 2), 2 * (rank // 2) + 1]
        assert result["tp2_dp"] == (rank // 2, 2)
        assert result["tp4_vocab"] == 256 and result["tp2_vocab"] == 512  # 1001 padded to 1024
        assert result["student_tp2_teacher_tp1_vocab"] == 1024  # the whole teacher beside a TP=2 student
        assert tuple(result["mla_experts_fc1"]) == (2 * 16 // 4, 32)  # each expert's gate and up rows: a quarter
        for key in ("tp4", "tp2", "student_tp2_teacher_tp4", "student_tp2_teacher_tp1", "mla_tp4"):
            reference = result["mla_reference" if key.startswith("mla") else "reference"]
            error = (result[key] - reference).abs() - 1e-6 * reference.abs()
            assert result[key].shape == ROWS[rank]
            assert error.numel() == 0 or error.max().item() <= 1e-6, (rank, key, error.max().item())


def test_a_megatron_core_without_process_group_collections_refuses_by_name(world):
    for result in world:
        assert ("unsupported" in result) == result["version"].startswith(("0.13.", "0.14."))
