"""The device rule on the teacher-at-its-own-layout path (issue 72 item 8, issue 73 item 3): on a GPU
job the groups are NCCL, which takes tensors on the current CUDA device only. In the 2-rank gloo
world of `layout_worlds.two_rank_world` (student CP=2, teacher `PATH;tp=2`), slime_opd's
`LayoutTeacher` is loaded and scored (`score`: the replica's agreement and gather, the forward, the
context-parallel sum; `topk_pass` at given ids: the width agreed over the job) while

- every group's backend reads `nccl` (`torch.distributed.get_backend`),
- `torch.cuda.is_available()` is True and `torch.cuda.current_device()` is 0, as the rule reads them,
- the agreement home's one move (`ops.agreement.on_device`) marks a tensor it puts on "cuda:0"
  (the tensors stay on the host, so gloo still runs the collectives), and
- every torch.distributed collective records the device of each tensor it receives (the mark, or
  the tensor's own device) and the module that called it.

What CPU cannot show is faked, what it can is real: the collectives run over gloo, the scores are
compared with the same teacher scored without the fake. Every collective a module of this package
calls must receive tensors on the rule's "cuda:0", except those that carry the models' own tensors
(megatron-core's forward, the vocabulary ops on the logits, the teacher pipeline's stage status and
scores, the student's ids made whole over its context-parallel group: on the model's device, which
is the GPU's on a GPU job). Before the fix, `gather.gathered`,
`layout_teacher._agreed_width` and the context-parallel sum sent host tensors."""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.inference.teacher_layout.layout_worlds import close, served, two_rank_world

pytestmark = [pytest.mark.megatron, pytest.mark.multirank, pytest.mark.slow]

RULE = "cuda:0"
_MISSING = object()
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "reduce_scatter_tensor", "send", "recv", "reduce", "gather", "scatter")
# modules whose collectives carry the models' own tensors (their device is the model's: the teacher's
# logits and stage outputs, the student's ids made whole over its context-parallel group)
MODEL_DATA = ("/megatron/core/", "/torch/distributed/nn/", "/megatron_rl_patches/ops/_dist.py",
              "/megatron_rl_patches/integrations/megatron/opd/zigzag.py",
              "/megatron_rl_patches/ops/kernels/", "/megatron_rl_patches/inference/teacher_layout/pipeline.py",
              "/megatron_rl_patches/inference/teacher_layout/scoring.py")


def _devices(value: object) -> list[str]:
    if isinstance(value, torch.Tensor):
        return [str(getattr(value, "fake_device", value.device))]
    if isinstance(value, (list, tuple)):
        return [device for item in value for device in _devices(item)]
    return []


@contextlib.contextmanager
def nccl_on_a_gpu(records: list[tuple[str, str, str, list[str]]]) -> Iterator[None]:
    """The fake described in the module docstring; `records` gets (file, function, collective,
    devices) per collective call."""
    import torch.distributed as dist

    from megatron_rl_patches.ops import agreement

    def marked(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        moved = tensor.view_as(tensor) if device.type == "cuda" else tensor.to(device).view_as(tensor)
        if device.type == "cuda":
            moved.fake_device = str(device)  # type: ignore[attr-defined]
        return moved

    def recording(name: str, original):
        def collective(*args, **kwargs):
            caller = sys._getframe(1)
            found = [device for value in (*args, *kwargs.values()) for device in _devices(value)]
            if name.endswith("_object") or name.endswith("_object_list"):
                found = ["object"]
            records.append((caller.f_code.co_filename, caller.f_code.co_name, name, found))
            return original(*args, **kwargs)

        return collective

    patches = [(dist, name, recording(name, getattr(dist, name))) for name in COLLECTIVES]
    patches += [(dist, "get_backend", lambda group=None: "nccl"), (agreement, "on_device", marked),
                (torch.cuda, "is_available", lambda: True), (torch.cuda, "current_device", lambda: 0)]
    saved = [(owner, name, vars(owner).get(name, _MISSING)) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            if value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


def device_checks(rank: int, world_size: int, root: str) -> dict:
    """slime_opd's `;tp=2` teacher beside a student at CP=2, scored with and without the fake."""
    from megatron_rl_patches.integrations.megatron.opd.opd_settings import TEACHERS, opd_settings
    from megatron_rl_patches.integrations.megatron.opd.opd_settings import K as K_SETTING
    from megatron_rl_patches.integrations.megatron.opd.opd_teachers import ScoringStep
    from megatron_rl_patches.integrations.megatron.opd.topk_request import IDS, TopkRequest
    from megatron_rl_patches.integrations.megatron.opd.zigzag import zigzag_of_whole
    from megatron_rl_patches.integrations.slime import opd as slime_opd
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu
    from tests.integrations.slime.test_slime_opd_layout_teacher import K, _rollout
    from tests.integrations.slime.tiny_actor import TinyActor

    settings = opd_settings({TEACHERS: f"{root};tp=2", K_SETTING: str(K)})
    records: list[tuple[str, str, str, list[str]]] = []
    results: dict = {}
    whole = _rollout(1)  # at CP=2 both ranks hold the same samples, each its zigzag rows of their ids
    lengths = (whole["total_lengths"], whole["response_lengths"])
    passed = {"tokens": whole["tokens"], **dict(zip(("total_lengths", "response_lengths"), lengths)),
              "given": whole[IDS]}
    with megatron_on_cpu(context_parallel=2):
        data = {**whole, IDS: zigzag_of_whole(whole[IDS], *lengths)}
        with nccl_on_a_gpu(records):
            try:
                (teacher,) = slime_opd.load_teachers(TinyActor(num_layers=3), settings)
            except ValueError as exc:  # megatron-core 0.13: no ProcessGroupCollection, refused alike by name
                if "ProcessGroupCollection" not in str(exc):
                    raise
                return {"unsupported": str(exc)}
            faked = teacher.score(ScoringStep(None, {**data, IDS: list(data[IDS])}, settings, True, {}, None))
            faked_pass = teacher.topk_pass(None, list(teacher), dict(passed), TopkRequest(ids_key="given"))
        plain = teacher.score(ScoringStep(None, {**data, IDS: list(data[IDS])}, settings, True, {}, None))
        plain_pass = teacher.topk_pass(None, list(teacher), dict(passed), TopkRequest(ids_key="given"))
    results["records"] = records
    results["faked"] = (faked.log_probs, faked.tails, faked_pass["topk_log_probs"], faked_pass["tail"])
    results["plain"] = (plain.log_probs, plain.tails, plain_pass["topk_log_probs"], plain_pass["tail"])
    return results


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return two_rank_world(tmp_path_factory, "device")


def _ours(path: str) -> bool:
    return "/megatron_rl_patches/" in Path(path).as_posix()


def _placed(records: list) -> tuple[list, set]:
    """(the collectives a module of this package calls with tensors it made, not the models'; their
    (file, function) sites)."""
    placed = [(Path(path).name, function, name, devices) for path, function, name, devices in records
              if _ours(path) and not any(part in Path(path).as_posix() for part in MODEL_DATA)]
    return placed, {(path, function) for path, function, _, _ in placed}


def test_every_collective_on_the_teacher_path_receives_tensors_on_the_rules_device(world):
    served(world)
    for rank, result in enumerate(world):
        placed, sites = _placed(result["records"])
        wrong = [record for record in placed if set(record[3]) - {RULE, "object"}]
        assert not wrong, (rank, wrong)
        # the replica's agreement and gather, the width over the job, the context-parallel sum: all
        # through the agreement home
        assert {("agreement.py", "agree"), ("agreement.py", "gathered"), ("agreement.py", "agreed_range"),
                ("agreement.py", "summed")} <= sites, (rank, sites)
        print(f"rank {rank}: {len(result['records'])} collectives, {len(placed)} placed by the rule at {RULE}: "
              f"{sorted(sites)}")


def test_the_fake_changes_no_score(world):
    served(world)
    for result in world:
        for faked, plain in zip(result["faked"], result["plain"]):
            assert len(faked) == len(plain) and all(close(a, b) == 0.0 or torch.equal(a, b)
                                                    for a, b in zip(faked, plain))


def test_a_role_at_its_own_layout_sends_its_micro_batch_count_on_the_rules_device(tmp_path_factory):
    """`role;tp=2` (slime's forward_only at the role's own layout, test_slime_role_layout.py's world):
    the micro-batch count agreed over the role's tensor-parallel group, and the replica's
    agreement and gather, on the rule's device; its scores unchanged by the fake."""
    world = two_rank_world(tmp_path_factory, "role")
    served(world)
    for rank, result in enumerate(world):
        placed, sites = _placed(result["nccl_records"])
        wrong = [record for record in placed if set(record[3]) - {RULE, "object"}]
        assert not wrong, (rank, wrong)
        assert {("agreement.py", "agreed_range"), ("agreement.py", "gathered")} <= sites, (rank, sites)
        for key in result["scores"]:
            assert all(torch.equal(a, b) for a, b in zip(result["nccl_scores"][key], result["scores"][key])), key
