"""The start-up hook's former module path: start-up files written by `megatron-rl-patches startup
install` before the hook moved to `patching.startup.hook` still import this name."""
from megatron_rl_patches.patching.startup.hook import has_run as has_run
from megatron_rl_patches.patching.startup.hook import run as run
