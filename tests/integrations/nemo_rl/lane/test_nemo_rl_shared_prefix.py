"""`nemo_rl_shared_prefix` on NeMo-RL 7ea279ab's own Megatron driver (sequence packing on), its
setting MEGATRON_RL_PATCHES_SHARED_PREFIX on against off: two groups of samples sharing their
prompts, interleaved in each micro-batch; the log-prob pass (NeMo-RL's logits path and the fused
head), the teacher's top-k pass, a GRPO training step (both routes) and a top-k distillation
training step, at TP = 1, TP = 2 with sequence parallelism, CP = 2 and CP = 2 x TP = 2 + SP (each
pass plans the packed micro-batch NeMo-RL keeps beside each rank's zigzag share); sequence packing off
packs whole with one warning in NeMo-RL's words, a ValueError under MEGATRON_RL_PATCHES_STRICT=1. A
world of 2 gloo ranks and one of 4 (shared_prefix_ranks.prefix_world). NeMo-RL's packed pipeline path
does not run on CPU (test_nemo_rl_lane.py's WORLDS says why): its door's verdict there, packed whole
(NeMo-RL pads every micro-batch to one length), is the table's (tests/integrations/shared_prefix_doors)."""
from __future__ import annotations

import pytest

pytest.importorskip("nemo_rl", reason="NeMo-RL's source is not on the path: run `make test-nemo NEMO_RL=...`")
pytestmark = [pytest.mark.nemo_rl, pytest.mark.multirank, pytest.mark.slow]

import shared_prefix_ranks as ranks  # noqa: E402

from megatron_rl_patches.testing import layouts  # noqa: E402
from megatron_rl_patches.testing.multirank import run_multirank  # noqa: E402

TOL = 1e-6  # float32, the same samples packed whole
WORLDS = {2: [ranks.layout("tp1"), ranks.layout("tp2-sp", tp=2, sp=True), ranks.layout("cp2", cp=2)],
          4: [ranks.layout("cp2-tp2-sp", tp=2, sp=True, cp=2)]}  # ranks: layouts
MARKS = {"tp1": ("thd",), "tp2-sp": ("tp2", "sp", "thd"), "cp2": ("cp2-zigzag", "thd"),
         "cp2-tp2-sp": ("cp2-zigzag", "tp2", "sp", "thd")}
PLANNED = [pytest.param(name, id=name, marks=layouts.mark(*marks)) for name, marks in MARKS.items()]
_RESULTS: dict = {}


def _figures(name: str) -> list[dict]:
    """Each rank's figures at one layout (its world spawned once, on first use)."""
    size = next(size for size, layouts in WORLDS.items() if any(layout["name"] == name for layout in layouts))
    if size not in _RESULTS:
        try:
            _RESULTS[size] = run_multirank(ranks.prefix_world, size, WORLDS[size], timeout=1500)
        except RuntimeError as exc:
            _RESULTS[size] = exc
        else:
            for rank, outs in enumerate(_RESULTS[size]):
                for out in outs:
                    print(f"rank {rank}: {out}")
    found = _RESULTS[size]
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


@pytest.mark.parametrize("name", [pytest.param("tp1", marks=layouts.mark("thd", "bshd")),
                                  pytest.param("tp2-sp", marks=layouts.mark("tp2", "sp", "bshd"))])
def test_without_sequence_packing_the_pass_says_so_once_and_runs_whole(name):
    for out in _figures(name):
        figures = out["unpacked"]
        assert figures["err"] == 0.0 and figures["tokens"][0] == figures["tokens"][1] > 0
        assert len(figures["said"]) == 1, figures["said"]
        for named in ("sequence packing is off", "policy.sequence_packing.enabled=true",
                      "MEGATRON_RL_PATCHES_SHARED_PREFIX=0"):
            assert named in figures["said"][0], named


def test_under_strict_the_same_words_raise_alike_on_every_rank():
    errors = [out["strict"]["error"] for out in _figures("tp2-sp")]
    assert errors[0] and errors[0] == errors[1], errors
    assert errors[0].startswith("MEGATRON_RL_PATCHES_SHARED_PREFIX=1 with MEGATRON_RL_PATCHES_STRICT=1: NeMo-RL's "
                                "log-prob pass")
    assert "policy.sequence_packing.enabled=true" in errors[0]
