"""The agreement home's counts, gather and sum without a group to agree over (None, or
torch.distributed not initialized): the value itself, no exchange; bad input refused by name before
any exchange. Their multi-rank use — on the group's device by the one rule — is checked in the
teacher-layout world (tests/integrations/slime/test_slime_layout_teacher_nccl_device.py), the
vocabulary ops' TP worlds and the served teachers' 2-rank failure agreement."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.ops import agreement


def test_without_a_group_each_returns_this_ranks_own_values():
    assert agreement.agreed_range(None, 7) == (7, 7)
    assert agreement.agreed_min(None, 0) == 0 and agreement.agreed_max(None, 3) == 3
    assert agreement.agreed_max(agreement.world(), 5) == 5  # torch.distributed not initialized: no world
    value = torch.arange(6).reshape(2, 3)
    (only,) = agreement.gathered(None, value)
    assert only is value
    total = agreement.summed(None, value)
    assert torch.equal(total, value) and total is not value  # a new tensor: the caller's stays untouched
    assert agreement.gathered_objects(None, ("rank", 0)) == [("rank", 0)]


@pytest.mark.parametrize("call, named", [
    (lambda: agreement.agreed_range(None, 1.5), "value must be an int"),
    (lambda: agreement.agreed_max(None, "3"), "value must be an int"),
    (lambda: agreement.gathered(None, [1, 2]), "gathered: tensor must be a torch.Tensor"),
    (lambda: agreement.summed(None, 2.0), "summed: tensor must be a torch.Tensor"),
])
def test_bad_input_is_a_type_error_naming_it(call, named):
    with pytest.raises(TypeError, match=named):
        call()


def test_the_device_rule_reads_the_groups_backend(monkeypatch):
    """gloo: the host, whatever CUDA says; NCCL: the current CUDA device (the host without CUDA)."""
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert agreement.group_device(object()) == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert agreement.group_device(object()) == torch.device("cpu")  # a mixed backend: gloo for host tensors
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert agreement.group_device(object()) == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert agreement.group_device(object()) == torch.device("cpu")
