"""`nemo_rl_shared_prefix` on NeMo-RL 7ea279ab's own Megatron driver (sequence packing on), its
setting MEGATRON_RL_PATCHES_SHARED_PREFIX on against off: two groups of samples sharing their
prompts, interleaved in each micro-batch; the log-prob pass (NeMo-RL's logits path and the fused
head), the teacher's top-k pass, a GRPO training step (both routes) and a top-k distillation
training step, at TP = 1 and TP = 2 with sequence parallelism; then context parallelism (refused)
in the same world. One world of 2 gloo ranks (shared_prefix_ranks.prefix_world)."""
from __future__ import annotations

import pytest

pytest.importorskip("nemo_rl", reason="NeMo-RL's source is not on the path: run `make test-nemo NEMO_RL=...`")
pytestmark = [pytest.mark.nemo_rl, pytest.mark.multirank, pytest.mark.slow]

import shared_prefix_ranks as ranks  # noqa: E402

from megatron_rl_patches.testing.multirank import run_multirank  # noqa: E402

TOL = 1e-6  # float32, the same samples packed whole
LAYOUTS = [ranks.layout("tp1"), ranks.layout("tp2-sp", tp=2, sp=True),
           ranks.layout("cp2", cp=2, refused=True)]
PLANNED = ["tp1", "tp2-sp"]
_RESULTS: list = []


def _figures(name: str) -> list[dict]:
    """Each rank's figures at one layout (the world spawned once, on first use)."""
    if not _RESULTS:
        try:
            _RESULTS.append(run_multirank(ranks.prefix_world, 2, LAYOUTS, timeout=1500))
        except RuntimeError as exc:
            _RESULTS.append(exc)
        else:
            for rank, outs in enumerate(_RESULTS[0]):
                for out in outs:
                    print(f"rank {rank}: {out}")
    found = _RESULTS[0]
    if isinstance(found, Exception):
        raise found
    return [next(out for out in rank if out["layout"] == name) for rank in found]


def _fewer(tokens: tuple[int, int]) -> bool:
    off, on = tokens
    return 0 < on < off


@pytest.mark.parametrize("name", PLANNED)
def test_logprobs_equal_with_fewer_tokens_at_the_embedding(name):
    for out in _figures(name):
        for route in ("logprobs_own", "logprobs_fused"):
            figures = out[route]
            assert figures["err"] <= TOL and figures["scale"] > 1.0, (route, figures)
            assert _fewer(figures["tokens"]), (route, figures["tokens"])


@pytest.mark.parametrize("name", PLANNED)
def test_the_teachers_topk_equal_with_fewer_tokens(name):
    for out in _figures(name):
        figures = out["topk"]
        assert figures["ids_equal"] and figures["err"] <= TOL and _fewer(figures["tokens"]), figures


@pytest.mark.parametrize("name", PLANNED)
def test_training_steps_losses_and_every_gradient_equal(name):
    for out in _figures(name):
        for step in ("grpo_own", "grpo_fused", "kd_fused"):
            figures = out[step]
            off, on = figures["loss"]
            assert off != 0.0 and abs(off - on) <= TOL, (step, figures)
            assert figures["grad_err"] <= TOL and figures["grad_scale"] > 1e-3, (step, figures)
            assert _fewer(figures["tokens"]), (step, figures["tokens"])


@pytest.mark.parametrize("name", PLANNED)
def test_without_sequence_packing_the_pass_says_so_and_runs_whole(name):
    for out in _figures(name):
        figures = out["unpacked"]
        assert figures["err"] == 0.0 and figures["tokens"][0] == figures["tokens"][1] > 0
        assert len(figures["said"]) == 1 and "sequence packing is off" in figures["said"][0]


def test_context_parallelism_is_refused_by_name_alike_on_every_rank():
    outs = _figures("cp2")
    said = [out["refused"]["said"] for out in outs]
    assert len(said[0]) == 1 and said[0] == said[1], said
    assert "context_parallel_size=2" in said[0][0] and "MEGATRON_RL_PATCHES_SHARED_PREFIX=0" in said[0][0]
    for out in outs:
        figures = out["refused"]
        assert figures["err"] == 0.0 and figures["tokens"][0] == figures["tokens"][1] > 0
