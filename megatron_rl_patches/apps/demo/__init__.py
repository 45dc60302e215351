"""The demo app: a real tiny megatron-core RL loop, with and without the patches.

`megatron-rl-patches demo` (megatron_rl_patches.apps.cli.demo) runs it; `loop` holds the loop,
`session` one run, `measure` the memory counters, `report` the summary text.
"""
