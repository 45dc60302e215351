"""This repository's own test kit (importable as `kit`: tests/ is on sys.path through its conftest):
the worlds and cases only these tests use. What a user testing their own pipeline would use lives in
the public `megatron_rl_patches.testing`."""
