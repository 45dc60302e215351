"""The applications built on the library: the command line (`cli/`), the demo, the benchmarks and
their presentation helpers. They may use `megatron_rl_patches.testing`; the library never
imports them (tests/test_import_graph.py holds that line)."""
