"""megatron-core: DistributedDataParallel forward-pre-hook toggles made idempotent."""
from megatron_rl_patches.integrations.megatron_version import SUPPORTED
from megatron_rl_patches.patching.registry import Patch

DDP = "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel"
# The version in use, also for a source checkout with no distribution metadata.
VERSION_FINDER = "megatron_rl_patches.integrations.megatron_version:installed_version"

PATCHES = (
    Patch(
        name="ddp_hooks",
        target=f"{DDP}.enable_forward_pre_hook",
        wrapper="megatron_rl_patches.reentrant:enable_forward_pre_hook_wrapper",
        description="enable_forward_pre_hook() is a no-op when the hooks are already registered",
        versions=SUPPORTED,
        version_finder=VERSION_FINDER,
        params=("self",),
    ),
    Patch(
        name="ddp_hooks",
        target=f"{DDP}.disable_forward_pre_hook",
        wrapper="megatron_rl_patches.reentrant:disable_forward_pre_hook_wrapper",
        description="disable_forward_pre_hook() with no hooks registered only does the param sync",
        versions=SUPPORTED,
        version_finder=VERSION_FINDER,
        params=("self", "param_sync"),
    ),
)
