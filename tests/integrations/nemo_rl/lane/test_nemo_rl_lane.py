"""NeMo-RL 7ea279ab's own Megatron driver (`get_microbatch_iterator` + `megatron_forward_backward`
with `LogprobsPostProcessor`, `TopkLogitsPostProcessor`, `LossPostProcessor` over `ClippedPGLossFn`
and `DistillationLossFn`) on a tiny GPTModel over gloo ranks, unpatched against `nemo_rl_fused_logprobs`,
`nemo_rl_topk` and `nemo_rl_topk_kd`. Each world is spawned once (nemo_ranks.layout_world runs every
check at each of its layouts); the tests read its figures."""
from __future__ import annotations

import pytest

pytest.importorskip("nemo_rl", reason="NeMo-RL's source is not on the path: run `make test-nemo NEMO_RL=...`")
pytestmark = [pytest.mark.nemo_rl, pytest.mark.multirank, pytest.mark.slow]

import nemo_kit as kit  # noqa: E402
import nemo_ranks as ranks  # noqa: E402

from megatron_rl_patches.testing.multirank import run_multirank  # noqa: E402

WORLDS = {
    # TP=1 (both ranks data-parallel), then TP=2 with sequence parallelism, unpacked and packed
    "tp": [ranks.layout("tp1", residency=True), ranks.layout("tp2-sp", tp=2, sp=True, residency=True),
           ranks.layout("tp2-sp-packed", tp=2, sp=True, packed=True)],
    # NeMo-RL serves context parallelism only with sequence packing (zigzag rows per sequence)
    "cp": [ranks.layout("cp2-packed", cp=2, packed=True)],
    # PP=2 unpacked only. Packed, NeMo-RL pads each micro-batch to one length for the pipeline's
    # fixed tensor shapes (pad_full_seq_to) and megatron-core's RoPE without Transformer Engine
    # (_apply_rotary_pos_emb_thd) splits by the unpadded cu_seqlens and refuses the padded rows
    # ("split_sizes [16, 0]" for 27 rows) in NeMo-RL's own unpatched forward: a CPU limit, not a patch's
    "pp": [ranks.layout("pp2", pp=2)],
}
LAYOUTS = [(world, layout["name"]) for world, layouts in WORLDS.items() for layout in layouts]
_RESULTS: dict[str, list | Exception] = {}


def _figures(world: str, name: str) -> list[dict]:
    """Each rank's figures at one layout (the world spawned once, on first use; printed then, a
    failed world's error kept and raised again, never spawned twice)."""
    if world not in _RESULTS:
        try:
            _RESULTS[world] = run_multirank(ranks.layout_world, 2, WORLDS[world], timeout=1500)
        except RuntimeError as exc:
            _RESULTS[world] = exc
        else:
            for rank, outs in enumerate(_RESULTS[world]):
                for out in outs:
                    print(f"rank {rank}: {out}")
    found = _RESULTS[world]
    if isinstance(found, Exception):
        raise found
    return [next(out for out in rank if out["layout"] == name) for rank in found]


def _last(world: str, name: str) -> list[dict]:
    return [out for out in _figures(world, name) if out["last_stage"]]


@pytest.mark.parametrize("world,name", LAYOUTS)
def test_logprobs_equal_nemo_rls_own_without_vocab_wide_logits(world, name):
    for out in _last(world, name):
        assert out["logprobs_err"] <= kit.TOL and out["logprobs_control"] > kit.CONTROL
        fused, plain = out["logprobs_bytes"]
        vocab = kit.VOCAB // (2 if name.startswith("tp2") else 1)
        # NeMo-RL's own path holds a micro-batch's logits (packed: one sample's rows at least); ours a tile
        assert plain >= 7 * vocab * 4 and fused <= kit.CHUNK * vocab * 4 < plain, (fused, plain)


@pytest.mark.parametrize("world,name", LAYOUTS)
def test_topk_ids_and_renormalized_values_equal_nemo_rls_own(world, name):
    for out in _last(world, name):
        assert out["topk_ids_equal"] and out["topk_err"] <= kit.TOL
        assert out["topk_mass_max"] <= 1 + 1e-6  # log-probs over the whole vocabulary: a tail is left
        assert out["topk_control"] > kit.CONTROL  # negative control: they are not NeMo-RL's raw logits


@pytest.mark.parametrize("world,name", LAYOUTS)
def test_grpo_loss_and_gradients_equal_nemo_rls_own(world, name):
    for out in _figures(world, name):
        own, fused = out["grpo_loss"]
        if out["last_stage"]:
            assert abs(own - fused) <= kit.TOL and own != 0.0
        assert out["grpo_grad_err"] <= kit.TOL and out["grpo_grad_scale"] > kit.CONTROL


@pytest.mark.parametrize("world,name", LAYOUTS)
def test_the_exact_distillation_loss_against_float64_and_nemo_rls_own(world, name):
    for out in _last(world, name):
        for kl_type in ("forward", "reverse", "mixed"):
            figures = out[f"kd_{kl_type}"]
            assert figures["exact"] >= 0 and abs(figures["exact"] - figures["float64"]) <= kit.TOL
            # NeMo-RL's own loss (zero_outside_topk: the teacher renormalized over k, a tail at log eps)
            # is another quantity: far from the exact one on these near-uniform tiny models
            assert abs(figures["nemo_rl_own"] - figures["exact"]) > kit.CONTROL


@pytest.mark.parametrize("world,name", [("tp", "tp1"), ("tp", "tp2-sp")])
def test_a_streamed_teacher_gives_the_same_topk_through_nemo_rls_route(world, name):
    for out in _last(world, name):
        figures = out["residency"]
        assert figures["same"] and figures["copies"] > 0
        assert figures["peak_device_weight_bytes"] < figures["resident_weight_bytes"]
