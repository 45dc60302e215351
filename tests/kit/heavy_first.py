"""The test modules that cost a lane's xdist workers most, heaviest first: `tests/conftest.py` puts them
at the head of the collection and the lanes run with `--no-loadscope-reorder`, so the two workers take
the long modules first and finish on short ones (longest first: one worker is never left alone with
a 40-second multi-rank world while the other idles). xdist's own order (most tests first) put a
module of one test that spawns a world, such as `test_hf_multirank.py`, among the last.

Measured: `--durations` of the main and newest lanes (2026-11-29), each module's top test durations
summed over both lanes; a module under 9 s is left in the collection's order after these. A module
renamed or removed here fails tests/test_heavy_first.py."""
from __future__ import annotations

HEAVIEST_FIRST = (
    "tests/docs/test_docs_snippets.py",
    "tests/inference/loading/hf/test_hf_multirank.py",
    "tests/patching/test_launcher.py",
    "tests/windows/test_train_layouts.py",
    "tests/docs/test_fresh_interpreter_blocks.py",
    "tests/patching/test_registry_orderings.py",
    "tests/integrations/megatron/test_megatron_version.py",
    "tests/packaging/test_startup_wheel.py",
    "tests/examples/test_served_teacher_example_cli.py",
    "tests/examples/test_teacher_layout_example.py",
    "tests/shared_prefix/test_layouts.py",
    "tests/shared_prefix/test_context_parallel_layouts.py",
    "tests/integrations/slime/test_slime_cross_teacher_ep.py",
    "tests/inference/teacher_layout/test_teacher_layout_hostile.py",
    "tests/inference/loading/hf/test_hf_load_memory.py",
    "tests/apps/bench/test_fused_bench.py",
    "tests/integrations/slime/test_slime_opd_teachers.py",
    "tests/inference/residency/test_residency_user_ops.py",
    "tests/windows/test_windows.py",
    "tests/apps/bench/test_load_bench.py",
    "tests/ops/kernels/test_triton_dispatch.py",
    "tests/processors/layouts/test_mtp_layouts.py",
    "tests/ops/invariance/test_invariant_triton.py",
    "tests/processors/layouts/test_cp_attention.py",
    "tests/ops/kernels/test_triton_topk_ids.py",
    "tests/apps/bench/test_ops_bench.py",
    "tests/ops/kernels/test_gemm_backend.py",
    "tests/inference/teacher_layout/test_teacher_layout_4rank.py",
    "tests/patching/test_threads.py",
    "tests/ops/invariance/test_invariant_tp.py",
    "tests/apps/bench/test_bench_quiet.py",
    "tests/patching/test_launcher_values.py",
    "tests/inference/teacher_layout/test_teacher_layout_families.py",
    "tests/shared_prefix/test_refusals.py",
    "tests/test_reentrant_train.py",
    "tests/testing/test_multirank.py",
    "tests/ops/kernels/test_triton_tp.py",
    "tests/apps/bench/test_teacher_layout_bench.py",
    "tests/processors/test_missing_hook_hint.py",
    "tests/patching/test_wrapper_pickling.py",
    "tests/inference/loading/test_weights.py",
    "tests/processors/layouts/test_pipeline_sp_layouts.py",
    "tests/packaging/test_install_requirements.py",
    "tests/integrations/megatron/test_megatron_lm_train.py",
    "tests/apps/bench/test_privileged_benches.py",
    "tests/cross_tokenizer/test_alignment_real.py",
    "tests/apps/bench/test_windows_bench.py",
    "tests/docs/test_doc_server_lines.py",
    "tests/inference/layer_major/test_layer_major_tp.py",
    "tests/processors/layouts/test_moe_layouts.py",
    "tests/test_aliases.py",
    "tests/inference/loading/hf/test_hf_qwen3_5.py",
    "tests/ops/kernels/test_triton_compile.py",
    "tests/docs/test_layouts_matrix.py",
    "tests/shared_prefix/test_moe_statistics.py",
    "tests/ops/invariance/test_invariant_native.py",
    "tests/ops/kernels/test_triton_divergence_kernels.py",
    "tests/apps/bench/test_distill_bench.py",
    "tests/ops/invariance/test_native_cache.py",
    "tests/integrations/slime/test_slime_cross_teachers.py",
)


def heavy_first(items: list) -> None:
    """`items` (pytest's collected tests) reordered in place: the modules of HEAVIEST_FIRST first, in
    its order; every other module after them, as collected (a stable sort: a module's own tests keep
    their order)."""
    rank = {path: i for i, path in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
