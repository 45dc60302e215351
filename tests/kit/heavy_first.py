"""The test modules that cost a lane's xdist workers most, heaviest first: `tests/conftest.py` puts them
at the head of the collection and the lanes run with `--no-loadscope-reorder`, so the two workers take
the long modules first and finish on short ones (longest first: one worker is never left alone with
a 40-second multi-rank world while the other idles). xdist's own order (most tests first) put a
module of one test that spawns a world, such as `test_hf_multirank.py`, among the last.

Measured: `--durations=0` of the main and newest lanes (2026-11-29, after megatron_world freed its
groups), each module's test durations summed over both lanes; a module under 9 s is left in the
collection's order after these. A module renamed or removed here fails tests/test_heavy_first.py."""
from __future__ import annotations

HEAVIEST_FIRST = (
    "tests/docs/test_docs_snippets.py",
    "tests/windows/test_train_layouts.py",
    "tests/inference/loading/hf/test_hf_multirank.py",
    "tests/shared_prefix/test_layouts.py",
    "tests/ops/kernels/test_triton_kernels.py",
    "tests/shared_prefix/test_context_parallel_layouts.py",
    "tests/ops/invariance/test_invariant_triton.py",
    "tests/examples/test_served_teacher_example_cli.py",
    "tests/integrations/megatron/test_megatron_version.py",
    "tests/patching/test_registry_orderings.py",
    "tests/inference/loading/hf/test_hf_load_memory.py",
    "tests/examples/test_teacher_layout_example.py",
    "tests/apps/bench/test_fused_bench.py",
    "tests/integrations/slime/test_slime_cross_teacher_ep.py",
    "tests/ops/invariance/test_invariant_tp.py",
    "tests/windows/test_windows.py",
    "tests/shared_prefix/test_held_segments.py",
    "tests/docs/test_fresh_interpreter_blocks.py",
    "tests/test_reentrant_train.py",
    "tests/shared_prefix/test_model_hooks.py",
    "tests/inference/loading/test_weights.py",
    "tests/ops/kernels/test_gemm_backend.py",
    "tests/ops/kernels/test_triton_topk_ids.py",
    "tests/ops/kernels/test_temperature_boundary_triton.py",
    "tests/integrations/slime/test_slime_opd_teachers.py",
    "tests/inference/residency/test_residency_user_ops.py",
    "tests/inference/teacher_layout/test_teacher_layout_hostile.py",
    "tests/processors/layouts/test_mtp_layouts.py",
    "tests/ops/kernels/test_triton_dispatch.py",
    "tests/processors/test_missing_hook_hint.py",
    "tests/patching/test_launcher_values.py",
    "tests/testing/test_multirank.py",
    "tests/inference/loading/hf/test_hf_qwen3_5.py",
    "tests/patching/test_threads.py",
    "tests/apps/bench/test_load_bench.py",
    "tests/patching/test_wrapper_pickling.py",
    "tests/apps/bench/test_ops_bench.py",
    "tests/apps/bench/test_teacher_layout_bench.py",
    "tests/cross_tokenizer/test_alignment_real.py",
    "tests/cross_tokenizer/test_losses.py",
    "tests/processors/layouts/test_cp_attention.py",
    "tests/apps/bench/test_bench_quiet.py",
    "tests/inference/teacher_layout/test_teacher_layout_4rank.py",
    "tests/ops/kernels/test_triton_tp.py",
    "tests/packaging/test_install_requirements.py",
    "tests/teachers/test_served_deadline.py",
    "tests/patching/test_launcher.py",
    "tests/inference/residency/test_roles_residency.py",
    "tests/integrations/megatron/test_megatron_lm_train.py",
    "tests/inference/residency/test_residency_user_code.py",
    "tests/shared_prefix/test_moe_statistics.py",
    "tests/inference/loading/hf/test_families_contract.py",
    "tests/packaging/test_startup_wheel.py",
    "tests/ops/kernels/test_triton_divergence_kernels.py",
    "tests/shared_prefix/test_refusals.py",
    "tests/windows/test_windows_finish.py",
    "tests/processors/layouts/test_moe_layouts.py",
    "tests/apps/demo/test_demo.py",
    "tests/apps/bench/test_windows_bench.py",
    "tests/ops/invariance/test_invariant_rows.py",
    "tests/apps/bench/test_privileged_benches.py",
    "tests/processors/layouts/test_pipeline_sp_layouts.py",
    "tests/integrations/slime/test_slime_layout_teacher_nccl_device.py",
    "tests/apps/bench/test_shared_prefix_bench.py",
    "tests/inference/residency/test_residency.py",
)


def heavy_first(items: list) -> None:
    """`items` (pytest's collected tests) reordered in place: the modules of HEAVIEST_FIRST first, in
    its order; every other module after them, as collected (a stable sort: a module's own tests keep
    their order)."""
    rank = {path: i for i, path in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
