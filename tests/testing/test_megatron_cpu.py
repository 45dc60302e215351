"""The CPU test kit runs real megatron-core and leaves nothing behind."""
import pytest
import torch

pytestmark = pytest.mark.megatron

OVERLAP = dict(overlap_grad_reduce=True, use_distributed_optimizer=True, overlap_param_gather=True)


def test_real_ddp_trains_through_the_real_schedule(megatron_cpu):
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads

    ddp = megatron_cpu.ddp(megatron_cpu.gpt(), **OVERLAP)
    assert isinstance(ddp, DistributedDataParallel) and ddp.use_forward_hook
    ddp.config.no_sync_func = ddp.no_sync
    ddp.config.finalize_model_grads_func = finalize_model_grads
    batches = [megatron_cpu.batch(seed=i) for i in range(2)]
    before = megatron_cpu.run_schedule([ddp], batches)
    assert len(before) == 2 and all(torch.isfinite(m["lm loss"]) for m in before)
    assert any(p.main_grad.abs().sum() > 0 for p in ddp.parameters())
    megatron_cpu.sgd_step([ddp], lr=0.5)
    ddp.zero_grad_buffer()
    after = megatron_cpu.run_schedule([ddp], batches)
    assert sum(m["lm loss"] for m in after) < sum(m["lm loss"] for m in before)


def test_unpatched_megatron_core_rejects_a_second_hook_toggle(megatron_cpu):
    ddp = megatron_cpu.ddp(megatron_cpu.gpt(), **OVERLAP)
    ddp.disable_forward_pre_hook()
    with pytest.raises(KeyError):
        ddp.disable_forward_pre_hook()
    ddp.enable_forward_pre_hook()
    with pytest.raises(AssertionError):
        ddp.enable_forward_pre_hook()


def test_same_seed_gives_same_weights_and_deterministic_forward(megatron_cpu):
    a, b = megatron_cpu.gpt(seed=3), megatron_cpu.gpt(seed=3)
    batch = megatron_cpu.batch()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert torch.equal(megatron_cpu.forward(a, batch), megatron_cpu.forward(b, batch))


def test_teardown_restores_torch_and_parallel_state():
    from megatron.core import parallel_state

    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    original = torch.cuda.current_device
    with megatron_on_cpu():
        assert torch.cuda.current_device() == "cpu"
        assert parallel_state.model_parallel_is_initialized()
    assert torch.cuda.current_device is original
    assert not parallel_state.model_parallel_is_initialized()
    assert not torch.distributed.is_initialized()


def test_fake_ddp_mirrors_upstream_failures(fake_ddp):
    ddp = fake_ddp()
    assert ddp.hooks_enabled
    ddp.disable_forward_pre_hook()
    assert ddp.param_syncs == [True]
    with pytest.raises(KeyError):
        ddp.disable_forward_pre_hook()
    ddp.enable_forward_pre_hook()
    with pytest.raises(AssertionError):
        ddp.enable_forward_pre_hook()
    ddp.start_param_sync.assert_called()  # a pytest-mock spy


def _layouts_in_turn(rank: int, world_size: int) -> tuple[list, list]:
    """Per layout: the groups it made, the groups left at its exit and the threads; and per layout the
    names of megatron-core's groups in the order made, those its `destroy_model_parallel` destroys
    itself, those destroyed after it in the order destroyed (torch's own `destroy_process_group`,
    recorded as it runs), and whether a group the block made itself lived on."""
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.distributed import distributed_c10d

    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    destroy, destroy_megatron = dist.destroy_process_group, parallel_state.destroy_model_parallel
    destroyed: list = []

    def recorded(group=None):
        destroyed.append(group.group_name)
        return destroy(group)

    def megatron_first() -> None:
        destroy_megatron()
        destroyed.append(None)  # what follows is megatron_world's own

    left, orders = [], []
    dist.destroy_process_group, parallel_state.destroy_model_parallel = recorded, megatron_first
    try:
        for layout in (dict(tensor_parallel=2), dict(context_parallel=2), dict(expert_parallel=2)):
            destroyed.clear()
            with megatron_on_cpu(**layout):
                made = [group.group_name for group in distributed_c10d._world.pg_map
                        if group is not dist.group.WORLD]
                own = dist.new_group([0, 1])  # the block's own group (a teacher layout's): not megatron-core's
            cut = destroyed.index(None)
            own_alive = own in distributed_c10d._world.pg_map
            orders.append((made, destroyed[:cut], destroyed[cut + 1:], own_alive))
            if own_alive:
                destroy(own)
            left.append((len(made) + 1, len(distributed_c10d._world.pg_map), len(os.listdir("/proc/self/task"))))
    finally:
        dist.destroy_process_group, parallel_state.destroy_model_parallel = destroy, destroy_megatron
    return left, orders


@pytest.mark.multirank
def test_a_world_that_lives_on_frees_the_groups_each_layout_made():
    """Inside a multi-rank world each layout's megatron-core groups are destroyed at its exit: torch's
    registry keeps them otherwise, three gloo threads each (a world of ~40 layouts held ~800 threads a
    rank, and two such worlds on two cores ran 14 times slower than either alone). Only megatron-core's:
    a group the block made itself lives on. Newest first, the order every rank agrees on (an NCCL
    communicator's abort is collective)."""
    from megatron_rl_patches.testing.multirank import run_multirank

    for left, orders in run_multirank(_layouts_in_turn, 2):
        assert all(made > 10 for made, _, _ in left), left  # megatron-core made its groups
        assert [after for _, after, _ in left] == [1, 1, 1], left  # the world's own group only
        threads = [count for _, _, count in left]
        assert threads[1] <= threads[0] and threads[2] <= threads[0], left
        for made, by_megatron, destroyed, own_alive in orders:
            assert destroyed == [name for name in made[::-1] if name not in by_megatron], (made, by_megatron)
            assert sorted(by_megatron + destroyed) == sorted(made)
            assert own_alive
