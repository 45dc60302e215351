"""MEGATRON_RL_PATCHES_SHARED_PREFIX=1 through verl 0.9.1's real engine at CP = 2 x TP = 2 with sequence
parallelism (verl's default beside TP), in one 4-rank gloo world: verl's `forward_backward_batch`
packs each sequence padded to 2 CP x TP and cuts it zigzag; the door rebuilds the whole micro-batch
from the context-parallel ranks' shares, plans it, and each rank runs its share of the shorter stream.
Both routes' training step and the forward-only pass against the same passes packed whole: log-probs,
entropy, the loss and every gradient (summed over the CP ranks, the norms' over the TP ranks too, as
`finalize_model_grads` does) within 1e-6; each rank's embedding its share of the samples' trie."""
from __future__ import annotations

import pytest

from megatron_rl_patches.testing import layouts

pytest.importorskip("verl.models", reason="verl is not installed: run `make test-verl` (the verl lane)")
pytestmark = [pytest.mark.verl, pytest.mark.multirank]

from prefix_checks import PREFIX_TOLERANCE, prefix_checks  # noqa: E402
from verl_kit import CONTROL, VOCAB  # noqa: E402

from megatron_rl_patches.testing.multirank import run_multirank  # noqa: E402


def _world(rank: int, world_size: int) -> dict:
    import verl.models.mcore.registry  # noqa: F401  (bound by name before any patch: see verl_kit)
    from verl.models.mcore.model_forward_fused import patch_fused_forward

    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    with megatron_on_cpu(tensor_parallel=2, context_parallel=2):
        model = build_packed_gpt(vocab_size=VOCAB, seed=3, context_parallel_layout="zigzag",
                                 tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2)
        patch_fused_forward(model)  # what verl's engine does at build time
        return prefix_checks(model, align=2, context=2)


@pytest.fixture(scope="module")
def cp_tp_world() -> list[dict]:
    return run_multirank(_world, 4, timeout=300)


@layouts.mark("cp2-zigzag", "sp", "tp2", "thd")
def test_shared_prefix_at_cp2_tp2_equals_each_sample_packed_whole(cp_tp_world):
    for rank, got in enumerate(cp_tp_world):
        print(rank, got)
        for what in ("unfused-train", "fused-train", "unfused-forward"):
            checks = got[what]
            errors = {key: checks[key] for key in ("log_probs", "entropy", "loss", "grads") if key in checks}
            assert {"log_probs", "entropy"} <= set(errors) and max(errors.values()) < PREFIX_TOLERANCE, (what, errors)
            assert checks["rows_whole"] == [got["logical_rows"]], what
            assert checks["rows_planned"] == [got["trie_rows"]] and got["trie_rows"] < got["logical_rows"], what
            assert checks["control"] > CONTROL, what
            if "grads" in checks:
                assert checks["same_names"], what
