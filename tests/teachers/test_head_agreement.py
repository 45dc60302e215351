"""Ranks holding different teacher heads, in one 2-rank gloo world: `TeacherHead.from_hf(tp_group=)`
with rank 0 on checkpoint A and rank 1 on checkpoint B of the same shapes, and `TeacherStep` with
whole heads A / B and heads of widths 16 / 24 — each the same ValueError on both ranks naming both
directories (rank 1 never raising alone); a copy of A at another path on rank 1 agrees; a pipelined
actor's step on one stage only compares nothing over the job at build. A head whose
vocabulary is larger than the student's is refused when the step is built, naming both sizes."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from megatron_rl_patches.teachers import LoopHost, ServedTeacher, TeacherBatch, TeacherHead, TeacherStep, local_host
from megatron_rl_patches.testing.hf_checkpoints import write_safetensors
from megatron_rl_patches.testing.multirank import run_multirank

V = 300
NOWHERE = "http://127.0.0.1:9"  # never asked: the steps below fail (or are built) before any request


def checkpoint(root, name: str, seed: int, hidden: int = 16) -> str:
    directory = root / name
    directory.mkdir()
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": V, "hidden_size": hidden,
              "torch_dtype": "float32"}
    (directory / "config.json").write_text(json.dumps(config))
    weight = torch.randn(V, hidden, generator=torch.Generator().manual_seed(seed))
    write_safetensors(directory / "model.safetensors", {"lm_head.weight": weight})
    return str(directory)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("agreement")
    paths = {"A": checkpoint(root, "A", 1), "B": checkpoint(root, "B", 2), "wide": checkpoint(root, "wide", 3, 24)}
    shutil.copytree(paths["A"], root / "A_copy")
    paths["A_copy"] = str(root / "A_copy")
    return paths


def outcome(call) -> str:
    try:
        call()
    except ValueError as error:  # a ServedTeacherRefusal (the step's agreed failure) is one
        return f"{type(error).__name__}: {error}"
    return "no error"


def step_outcome(first: str, other: str, rank: int) -> str:
    import torch.distributed as dist

    host = LoopHost(V, share_group=dist.group.WORLD, job_group=dist.group.WORLD)
    head = TeacherHead.from_hf(first if rank == 0 else other)

    def run() -> None:
        with ServedTeacher(NOWHERE, "vllm", top_k=4, head=head) as teacher:
            step = TeacherStep([teacher], host)
            step.send(TeacherBatch([torch.tensor([1, 2, 3])], [1]))
            step.collect()

    return outcome(run)


def rank_heads(rank: int, world_size: int, paths: dict) -> dict:
    import torch.distributed as dist

    world = dist.group.WORLD
    out = {"tp": outcome(lambda: TeacherHead.from_hf(paths["A"] if rank == 0 else paths["B"], tp_group=world))}
    # one checkpoint, another dtype asked on rank 1: the agreement names the differing fact
    out["dtype"] = outcome(lambda: TeacherHead.from_hf(paths["A"], tp_group=world,
                                                       dtype=torch.float32 if rank == 0 else torch.bfloat16))
    copy = TeacherHead.from_hf(paths["A"] if rank == 0 else paths["A_copy"], tp_group=world)
    out["tp_copy"] = (copy.weight.clone(), copy.first_id)
    out["step"] = step_outcome(paths["A"], paths["B"], rank)
    out["widths"] = step_outcome(paths["A"], paths["wide"], rank)
    host = LoopHost(V, share_group=world, job_group=world)
    with ServedTeacher(NOWHERE, "vllm", top_k=4, head=paths["A"] if rank == 0 else paths["A_copy"]) as teacher:
        out["step_copy"] = TeacherStep([teacher], host).heads_failure
    out["off_stage"] = outcome(lambda: pipelined(rank, paths["A"]))
    return out


def pipelined(rank: int, path: str) -> None:
    """A pipelined actor's two stages: the last (rank 0) holds the step, no sharing group, a head
    larger than the student's vocabulary; the other (rank 1) only joins the build's agreement and
    the collect's, as slime's off-stage ranks do — the refusal reaches it."""
    import torch.distributed as dist

    from megatron_rl_patches.teachers.agreement import agree_failure
    from megatron_rl_patches.teachers.step.teacher_step import join_build

    host = LoopHost(256, share_group=None, job_group=dist.group.WORLD)
    if rank == 1:
        join_build(host)  # its part of the build's agreement over the job (slime's served_opd does the same)
        agree_failure(None, dist.group.WORLD)
        return
    with ServedTeacher(NOWHERE, "vllm", top_k=4, head=path) as teacher:
        step = TeacherStep([teacher], host)
        step.send(TeacherBatch([torch.tensor([1, 2, 3])], [1]))
        step.collect()


@pytest.mark.multirank
def test_ranks_holding_different_heads_are_refused_alike_on_every_rank(heads):
    ranks = run_multirank(rank_heads, 2, heads, timeout=300)
    for case, (a, b) in {"tp": ("A", "B"), "step": ("A", "B"), "widths": ("A", "wide")}.items():
        said = [result[case] for result in ranks]
        assert said[0] == said[1], case  # the same error on both ranks: rank 1 never raises alone
        assert "different teacher heads" in said[0] and heads[a] in said[0] and heads[b] in said[0], (case, said[0])
    assert "hidden 24" in ranks[0]["widths"] and "hidden 16" in ranks[0]["widths"]
    assert ranks[0]["tp"].startswith("ValueError: TeacherHead.from_hf: the ranks of the tensor-parallel group hold "
                                     "different teacher heads"), ranks[0]["tp"]
    for result in ranks:  # the differing fact named on both ranks, with each rank's value
        assert result["dtype"] == ("ValueError: TeacherHead.from_hf: dtype differs between the ranks of the "
                                   "tensor-parallel group [0, 1] (rank 0: torch.float32, rank 1: torch.bfloat16): "
                                   "pass the same dtype on every rank"), result["dtype"]
    for result in ranks:
        assert f"vocabulary of {V}, larger than the student's 256" in result["off_stage"], result["off_stage"]
    # the positive control: a copy of A at another path agrees (a TP head of A's rows on both ranks)
    whole = TeacherHead.from_hf(heads["A"], make_vocab_size_divisible_by=256).weight
    for rank, result in enumerate(ranks):
        weight, first = result["tp_copy"]
        assert first == 256 * rank and torch.equal(weight, whole[first:first + 256])
        assert result["step_copy"] is None


def test_a_head_larger_than_the_students_vocabulary_is_refused_when_the_step_is_built(heads):
    with ServedTeacher(NOWHERE, "vllm", top_k=4, head=heads["A"]) as teacher:
        with pytest.raises(ValueError, match=f"vocabulary of {V}, larger than the student's 256"):
            TeacherStep([teacher], local_host(256))
        assert TeacherStep([teacher], local_host(V)).heads_failure is None
