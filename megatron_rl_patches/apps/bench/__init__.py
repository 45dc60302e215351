"""Benchmarks behind `megatron-rl-patches bench` (memory and speed, printed, CSV and PNG)."""
