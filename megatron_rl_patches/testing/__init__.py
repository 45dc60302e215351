"""CPU test kit: run real megatron-core on a CPU-only machine (pytest plugin `megatron_rl_patches`).

Fixtures: `megatron_cpu` (gloo world of size 1, model-parallel state, CPU shims, full teardown),
`tiny_gpt` (factory of a tiny real GPTModel), `megatron_cpu_kind` (`megatron_cpu` once per model
kind: GPTModel, then HybridModel where megatron-core >= 0.18 has it), `fake_ddp` (a DDP stand-in).
Library code never imports this package: the shims exist for tests and the CPU demo only.
"""
