"""Host-memory builds without a GPU to see it: the factory redirect a swap/stream build runs the
provider under, and what is moved to the device afterwards (every tensor but the managed weights)."""
from __future__ import annotations

import torch

from megatron_rl_patches.inference.residency.host_init import host_initialization, move_all_but


def test_cuda_factories_land_on_the_cpu_inside_the_redirect():
    with host_initialization(True):
        made = [torch.empty(2, device="cuda"), torch.zeros(2, device=0), torch.ones(2, device=torch.device("cuda", 0)),
                torch.ones(2).cuda(), torch.ones(2).to("cuda"), torch.ones(2).to(0)]
        kept = torch.ones(2, dtype=torch.float64, device="cpu")
    assert all(t.device.type == "cpu" for t in made) and kept.dtype == torch.float64
    with host_initialization(False):  # inactive: nothing rewritten (and no mode left behind)
        assert torch.ones(1).to(torch.float16).dtype == torch.float16


def test_everything_but_the_managed_weights_moves_to_the_device():
    class Rotary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inv_freq = torch.ones(4)  # a plain attribute: Module.to would not move it
            self.register_buffer("table", torch.ones(3))
            self.scale = torch.nn.Parameter(torch.ones(2))
            self.weight = torch.nn.Parameter(torch.ones(5))

    module = Rotary()
    move_all_but([module], torch.device("meta"), {id(module.weight)})
    assert module.inv_freq.is_meta and module.table.is_meta and module.scale.is_meta
    assert not module.weight.is_meta and isinstance(module.scale, torch.nn.Parameter)
