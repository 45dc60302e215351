"""slime's own gated-delta-net layers (Qwen3.5's and Qwen3-Next's `Attention(HuggingfaceAttention)`,
slime_plugins/models/qwen3_5.py and qwen3_next.py, 624b824a) under a shared-prefix plan: a tiny hybrid
built from slime's spec (3 gated delta nets, 1 full attention; slime_gdn_ranks.py) against the same
GRPO groups packed whole as slime packs them (thd, cu_seqlens: slime's layer runs each sequence
alone): the sample rows' log-probs and entropy within 2e-6 and every parameter's gradient within
5e-5 of its scale (float32: measured 1.4e-6 and 2.4e-5; the recurrence's backward sums the remainders'
gradients into the prefix's state in another order, and a token-by-token rule in place of the chunked
one measures the same 2.4e-5), at one rank and at TP = 2 with sequence parallelism (slime's
layer is duplicated over the tensor-parallel ranks, the stream gathered around it); fewer tokens
embedded; the prepared model's ordinary call unchanged bit for bit. At CP = 2 (zigzag and slime's
--allgather-cp contiguous ids; the layer gathers every rank's share of the physical stream, the
gradient summed back over the ranks) the same against the samples packed whole at CP = 1 (measured
2.2e-7 and 3.8e-5, its recurrence token by token: the chunked one rounds to 5e-4 of a gradient there,
its chunks starting elsewhere under the drawn decays); at CP = 4 in a world of 4 ranks (measured
2.2e-7 and 2.1e-5). And slime's real `train_actor` at 1 rank and at PP = 2 on the Qwen3.5
hybrid (a reference pass, two snapshot OPD teachers, the old log-prob pass, train() over two
rollouts) with MEGATRON_RL_PATCHES_SHARED_PREFIX=1 against 0: the losses, the old and reference
log-probs, the teachers' log-probs and the weights after the last step within 2e-6 of their scale,
the ids the same, fewer tokens embedded (its recurrence token by token: the chunked one rounds to 2e-5
under the snapshots' strong decays, slime_fla_cpu.py)."""
from __future__ import annotations

import sys

import pytest
import torch
from slime_prefix_cases import close  # the lane's helpers (its directory is on the path)

from megatron_rl_patches.testing import layouts

pytestmark = pytest.mark.slime
TOL, GRAD_TOL = 2e-6, 5e-5


def _slime_plugins() -> None:
    if "slime_standins" not in sys.modules:  # the lane's conftest installs them where slime's source is found
        pytest.skip("slime is not importable; run `make test-slime SLIME=... MEGATRON_LM=...`")
    pytest.importorskip("slime_plugins.models.hf_attention", reason="slime_plugins is not exported in this lane")


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max()) / max(1.0, float(want.abs().max()))


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "tp2sp"])
def layer_runs(request, tmp_path_factory):
    _slime_plugins()
    import slime_gdn_ranks

    from megatron_rl_patches.testing.multirank import run_multirank

    root = str(tmp_path_factory.mktemp("hf"))
    return run_multirank(slime_gdn_ranks.planned_and_packed, request.param, root, request.param > 1, timeout=400)


def _gradients(ranks: list[dict], kind: str, route: str) -> list[dict[str, torch.Tensor]]:
    """Each rank's gradients, those of a parameter over sequence-parallel rows summed over the ranks
    (each rank holds its share of the rows; the plan's shares are other rows than the packed path's)."""
    split = ranks[0][kind]["split_rows"]
    summed = {name: sum(rank[kind][route]["grads"][name] for rank in ranks) for name in split}
    return [{**rank[kind][route]["grads"], **summed} for rank in ranks]


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_slimes_gated_delta_net_planned_equals_packed_whole(slime_cpu, layer_runs, kind):
    for rank, packed_grads, planned_grads in zip(layer_runs, _gradients(layer_runs, kind, "packed"),
                                                 _gradients(layer_runs, kind, "planned")):
        packed, planned = rank[kind]["packed"], rank[kind]["planned"]
        for field in ("log_probs", "entropy"):
            assert _relative(planned[field], packed[field]) <= TOL, field
        assert packed_grads.keys() == planned_grads.keys()
        assert any("linear_attn.conv1d" in name for name in packed_grads)
        for name, want in packed_grads.items():
            assert _relative(planned_grads[name], want) <= GRAD_TOL, name
            assert float(want.abs().max()) > 0, name  # every parameter reached
        assert sum(planned["embedded"]) < sum(packed["embedded"])
        again = rank[kind]["again"]  # a prepared layer's ordinary call: bit for bit as before
        assert torch.equal(again["log_probs"], packed["log_probs"])
        assert all(torch.equal(again["grads"][name], want) for name, want in rank[kind]["packed"]["grads"].items())


def test_slimes_gated_delta_net_at_context_parallelism_equals_the_samples_packed_whole(slime_cpu, layer_runs):
    """CP = 2 (the 2-rank world again): each rank its zigzag or contiguous share of the ids, the layer
    gathering the whole physical stream; log-probs, entropy, the objective and every gradient summed
    over the CP ranks against the same samples packed whole at CP = 1."""
    if "cp2" not in layer_runs[0]:
        pytest.skip("context parallelism runs in the 2-rank world")
    want = {f"{kind}/{cut}" for kind in ("qwen3_5", "qwen3_next") for cut in ("zigzag/0", "contiguous/2")}
    for rank in layer_runs:
        assert set(rank["cp2"]) == want
        for name, (lp, ent, loss, grads, rows, same_parameters) in rank["cp2"].items():
            assert rows > 0 and same_parameters, name
            assert lp <= TOL and ent <= TOL and loss <= TOL and grads <= GRAD_TOL, (name, lp, ent, loss, grads)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    _slime_plugins()
    import slime_gdn_ranks

    from megatron_rl_patches.testing.multirank import run_multirank

    root = str(tmp_path_factory.mktemp("hf"))
    return run_multirank(slime_gdn_ranks.planned_at_context_parallelism, 4, root,
                         (("zigzag", 0), ("contiguous", 1)), timeout=400)


def test_slimes_gated_delta_net_at_four_context_parallel_ranks_equals_the_samples_packed_whole(slime_cpu,
                                                                                               four_ranks):
    """CP = 4 (qwen3-next-80B-A3B's and qwen3.5-27B's scripts' CP_SIZE; a world of its own: the
    lane has no other 4-rank gated-delta-net world), zigzag and contiguous ids."""
    want = {f"{kind}/{cut}" for kind in ("qwen3_5", "qwen3_next") for cut in ("zigzag/0", "contiguous/1")}
    for rank in four_ranks:
        assert set(rank) == want
        for name, (lp, ent, loss, grads, rows, same_parameters) in rank.items():
            assert rows > 0 and same_parameters, name
            assert lp <= TOL and ent <= TOL and loss <= TOL and grads <= GRAD_TOL, (name, lp, ent, loss, grads)


LINEAR_ADAM = ("--adam-eps", "1.0")  # an update about lr · gradient (as test_slime_shared_prefix_lane.py)


@pytest.fixture(scope="module", params=[pytest.param(1, id="1rank", marks=layouts.mark("thd")),
                                        pytest.param(2, id="pp2", marks=layouts.mark("pp2", "thd"))])
def actor_runs(request, tmp_path_factory):
    _slime_plugins()
    import slime_gdn_ranks

    from megatron_rl_patches.testing.multirank import run_multirank

    root = str(tmp_path_factory.mktemp("hf"))
    stages = request.param
    return {on: run_multirank(slime_gdn_ranks.hybrid_train_actor, stages, root, "qwen3_5", on, LINEAR_ADAM, stages,
                              timeout=600)
            for on in (False, True)}


def _worst(got, want) -> float:
    """The largest difference relative to its scale (for the assertion's message)."""
    if isinstance(want, dict):
        return max([_worst(got[k], want[k]) for k in want] or [0.0])
    if isinstance(want, (list, tuple)):
        return max([_worst(g, w) for g, w in zip(got, want)] or [0.0])
    if isinstance(want, torch.Tensor) and want.is_floating_point() and want.numel():
        return _relative(got, want)
    return 0.0 if got == want or isinstance(want, torch.Tensor) else float("inf")


def test_train_actor_on_slimes_qwen3_5_hybrid_equals_the_setting_off(slime_cpu, actor_runs):
    """At 1 rank and at PP = 2 (slime's layers on both stages: 2 gated delta nets, then 1 and the
    attention layer); at PP = 2 the reference's log-probs within 5e-6 (measured 2.4e-6: peaked,
    as test_slime_shared_prefix_lane.py's CP = 2 run allows them), the rest within 2e-6."""
    off, on = actor_runs[False], actor_runs[True]
    last = off[-1]
    assert last["ids"] is not None and last["losses"]  # the last stage reports them
    for plain, planned in zip(off, on):
        for field in ("losses", "old_log_probs", "ref_log_probs", "ids", "teacher_logprobs"):
            tol = 5e-6 if field == "ref_log_probs" and len(off) > 1 else TOL
            assert close(planned[field], plain[field], tol), f"{field}: {_worst(planned[field], plain[field])}"
        assert close(planned["updated"], plain["updated"], TOL), "weights after the last step"
        assert plain["prefix_passes"] == [] and len(planned["prefix_passes"]) >= 4
    assert sum(on[0]["embedded"]) < sum(off[0]["embedded"])  # the first stage embeds
