"""A shared-prefix plan at context parallelism beside the other layouts and model features, on real
megatron-core over 4 gloo ranks (one world for the module; megatron's parallel state made again for
each layout): each CP rank builds the plan of the whole micro-batch and passes its zigzag or
contiguous share of the ids; log-probs, entropy, the objective and every gradient (summed over the
CP ranks, the norms' over the TP ranks) equal the same samples packed whole at CP = 1 with the same
weights, at CP = 2 x TP = 2 with sequence parallelism; an MoE model at CP = 2 x EP = 2 (expert bias
at update rate 0, as slime's MoE scripts run it; and with an aux loss, z-loss and expert-bias
updates acting, also at CP = 2 x TP = 2 + SP x EP = 2: the logged losses and the token counts over
the CP ranks, the bias after megatron's update); multi-latent attention at CP = 2 (its own rotary
table read at each physical row's position on each rank's share, values narrower than queries and
keys gathered over the ranks); CP = 2 x PP = 2 through megatron-core's schedule, on a dense model and
on one with MLA and MoE together (deepseek-r1's and kimi-k2's features); CP = 4 on a dense model
(zigzag and contiguous ids); a 2-deep MTP block at CP = 2 x TP = 2 + SP (zigzag against megatron-core's
own packed path, contiguous against CP = 1: each depth's stream cut over the ranks, its loss and
gradients), MTP beside MLA and MoE at CP = 2, and MTP at CP = 2 x PP = 2 against megatron-core's own
packed path through its schedule. Ranks that cut their ids in different layouts are refused by name on
all four ranks alike before anything runs."""
from __future__ import annotations

import pytest

from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.multirank import run_multirank

pytestmark = [pytest.mark.megatron, pytest.mark.multirank, pytest.mark.slow]


def _moe_batches():
    from kit.moe_statistics import constant_padding

    return [constant_padding(((60, (4, 8, 12, 4)),), (8,), padding=4),  # every sequence a multiple of 2 * CP
            constant_padding(((33, (3, 7)), (21, (3, 7, 11))), (), padding=8, seed=1)]


def _moe(statistics: bool, runs, sequence_parallel: bool = False) -> dict:
    from kit.context_parallel_prefix import beside_exactness, context_parallel_served
    from kit.moe_statistics import STATISTICS

    from megatron_rl_patches.testing.moe_gpt import tiny_moe_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    if not context_parallel_served():
        return {}
    acting = {**STATISTICS["aux-loss"], **STATISTICS["z-loss"], **STATISTICS["expert-bias"]}
    at_rate_0 = dict(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0,
                     moe_router_score_function="sigmoid")

    split = dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1)

    def build(cp: int):
        config = tiny_moe_config(expert_parallel=2, context_parallel_size=cp, num_query_groups=2,
                                 **(split if sequence_parallel else {}), **(acting if statistics else at_rate_0))
        return build_packed_gpt(seq_length=512, seed=9, config=config,
                                context_parallel_layout="zigzag" if cp > 1 else None)

    parallel = dict(expert_parallel=2, **(dict(tensor_parallel=2, expert_tensor_parallel=1) if sequence_parallel
                                          else {}))
    return beside_exactness(build, parallel, _moe_batches(), runs, statistics=statistics)


def _latent_attention() -> dict:
    from kit.context_parallel_prefix import beside_exactness, context_parallel_batches, context_parallel_served
    from kit.latent_gpt import build_mla_gpt, tiny_mla_config

    if not context_parallel_served():
        return {}

    def build(cp: int):
        return build_mla_gpt(tiny_mla_config(context_parallel_size=cp),
                             context_parallel_layout="zigzag" if cp > 1 else None)

    return beside_exactness(build, {}, context_parallel_batches(), [("zigzag", 2)])


def _latent_moe_pipeline() -> dict:
    """MLA + MoE (expert bias at update rate 0) + PP = 2 + CP = 2 in one model, as slime's deepseek-r1
    and kimi-k2 scripts run them together."""
    from kit.context_parallel_prefix import pipeline_exactness
    from kit.latent_gpt import build_mla_gpt, tiny_mla_config

    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall", moe_ffn_hidden_size=64,
               moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, add_bias_linear=False,
               moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0, moe_router_score_function="sigmoid")

    def build(cp: int, pre_process: bool, post_process: bool):
        config = tiny_mla_config(context_parallel_size=cp, pipeline_model_parallel_size=2, batch_p2p_comm=False,
                                 variable_seq_lengths=True, **moe)
        return build_mla_gpt(config, context_parallel_layout="zigzag" if cp > 1 else None, pre_process=pre_process,
                             post_process=post_process)

    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    # the MoE checks before ran their aux losses outside a schedule, leaving a 0-d scale the schedule's
    # [1] one cannot be copied into (tests/shared_prefix/conftest.py): the schedule makes its own
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    return pipeline_exactness(build_stage=build)


def _mtp() -> dict:
    from functools import partial

    from kit.mtp_context_parallel import dense_mtp_gpt, mtp_beside_context_parallelism

    build = partial(dense_mtp_gpt, tensor_model_parallel_size=2, sequence_parallel=True)
    return mtp_beside_context_parallelism([("zigzag", 0), ("contiguous", 1)], build, tensor_parallel=2)


def _latent_moe_mtp() -> dict:
    from kit.latent_gpt import mla_takes_packed_input
    from kit.mtp_context_parallel import latent_moe_mtp_gpt, mtp_beside_context_parallelism

    if not mla_takes_packed_input():
        return {}
    return mtp_beside_context_parallelism([("zigzag", 0)], latent_moe_mtp_gpt, packed_at_cp2=False)


def _pipeline_mtp() -> dict:
    from kit.mtp_context_parallel import mtp_pipeline_context_parallelism

    return mtp_pipeline_context_parallelism()


def _world(rank: int, world_size: int) -> dict:
    from kit.context_parallel_prefix import context_parallel_exactness, pipeline_exactness
    from kit.context_parallel_shares import share_checks

    return {"cp2-tp2-sp": context_parallel_exactness(2, True, [("zigzag", 2), ("contiguous", 0)],
                                                           mixed_layouts=True),
            "cp2-ep2-moe": _moe(False, [("zigzag", 0)]),
            "cp2-ep2-statistics": _moe(True, [("zigzag", 1)]),
            "cp2-tp2-sp-ep2-statistics": _moe(True, [("contiguous", 0)], sequence_parallel=True),
            "cp2-mla": _latent_attention(),
            "cp2-pp2": pipeline_exactness(),
            "cp2-pp2-mla-moe": _latent_moe_pipeline(),
            "cp4": context_parallel_exactness(1, False, [("zigzag", 0), ("contiguous", 1)], context_parallel=4),
            "cp2-mtp": _mtp(),
            "cp2-pp2-mtp": _pipeline_mtp(),
            "cp2-mla-moe-mtp": _latent_moe_mtp(),
            "cp2-tp2-shares": share_checks()}


@pytest.fixture(scope="module")
def world():
    return run_multirank(_world, 4, timeout=400)


@layouts.mark("tp2", "sp")
@pytest.mark.parametrize("layout", [pytest.param("zigzag", marks=layouts.mark("cp2-zigzag")),
                                    pytest.param("contiguous", marks=layouts.mark("cp2-allgather"))])
def test_context_parallelism_with_tensor_and_sequence_parallelism_equals_the_samples_packed_whole(world, layout):
    from kit.context_parallel_prefix import assert_exact

    assert_exact([rank["cp2-tp2-sp"] for rank in world], layout)


@layouts.mark("moe", "ep2", "cp2-zigzag")
def test_moe_beside_context_parallelism_routes_each_token_as_packed_whole(world):
    from kit.context_parallel_prefix import assert_exact

    assert_exact([rank["cp2-ep2-moe"] for rank in world], "zigzag")


@layouts.mark("moe", "ep2")
@pytest.mark.parametrize("layout", [
    pytest.param("cp2-ep2-statistics", marks=layouts.mark("cp2-zigzag")),
    pytest.param("cp2-tp2-sp-ep2-statistics", marks=layouts.mark("cp2-allgather", "tp2", "sp"))])
def test_moe_statistics_beside_context_parallelism_count_each_samples_rows_across_the_ranks(world, layout):
    from kit.context_parallel_prefix import GRAD_TOL, TOL

    if not world[0][layout]:
        pytest.skip("megatron-core < 0.16 refuses a plan at context parallelism by name")
    for rank in world:
        (lp, ent, loss, grads, rows, losses, counts, bias), = rank[layout].values()
        assert rows > 0 and lp < TOL and ent < TOL and loss < TOL and grads < GRAD_TOL, (lp, ent, loss, grads)
        assert set(losses) == {"load_balancing_loss", "z_loss"} and max(losses.values()) < TOL, losses
        assert counts == bias == 2, (counts, bias)  # both layers' counts and updated bias


@layouts.mark("cp2-zigzag")
def test_multi_latent_attention_beside_context_parallelism_equals_the_samples_packed_whole(world):
    from kit.context_parallel_prefix import assert_exact

    assert_exact([rank["cp2-mla"] for rank in world], "zigzag")


@layouts.mark("cp2-zigzag", "pp2")
@pytest.mark.parametrize("model", [
    "cp2-pp2", pytest.param("cp2-pp2-mla-moe", marks=layouts.mark("moe"))])
def test_context_parallelism_beside_pipeline_stages_equals_the_samples_packed_whole(world, model):
    """A dense model, and MLA + MoE (expert bias at rate 0) together in one model."""
    from kit.context_parallel_prefix import GRAD_TOL, TOL

    if not world[0][model]:
        pytest.skip("megatron-core < 0.16 refuses a plan at context parallelism by name")
    assert [rank[model]["last"] for rank in world] == [False, False, True, True]
    for rank in world:
        checks = rank[model]
        assert checks["micro_batches"] == (2 if checks["last"] else 0) or not checks["last"]
        assert checks["log_probs"] < TOL and checks["grads"] < GRAD_TOL, checks


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_four_context_parallel_ranks_equal_the_samples_packed_whole(world, layout):
    """CP = 4 (slime's deepseek-r1, kimi-k2, qwen3-next and qwen3.5 scripts' CP_SIZE): each rank its
    eighth-chunk pair of the physical stream, against the same samples packed whole at CP = 1."""
    from kit.context_parallel_prefix import assert_exact

    assert_exact([rank["cp4"] for rank in world], layout)


@layouts.mark("mtp", "tp2", "sp")
@pytest.mark.parametrize("layout", [pytest.param("zigzag", marks=layouts.mark("cp2-zigzag")),
                                    pytest.param("contiguous", marks=layouts.mark("cp2-allgather"))])
def test_mtp_beside_context_parallelism_equals_the_samples_packed_whole(world, layout):
    """A 2-deep MTP block at CP = 2 x TP = 2 + SP: each rank's layer runs its share of each depth's stream
    (the rows counted independently), the main loss, each depth's MTP loss and every gradient (summed
    over the CP ranks, the norms' over the TP ranks) equal megatron-core's own packed path at CP = 2 x
    TP = 2 + SP (zigzag: its own exchange of the rolled tokens; each rank's MTP loss as logged) or the
    samples packed whole at TP = 2 (contiguous: the ranks' per-token MTP losses summed)."""
    from kit.mtp_context_parallel import assert_mtp_exact

    assert_mtp_exact([rank["cp2-mtp"] for rank in world], layout)


@layouts.mark("mtp", "moe", "cp2-zigzag")
def test_mtp_beside_latent_attention_and_moe_at_context_parallelism_equals_the_samples_packed_whole(world):
    """glm4.7-30B-A3B's kind at CP = 2: MLA, MoE with expert bias at update rate 0, one MTP layer mirroring
    them; against the samples packed whole at CP = 1 (the gradients where megatron-core sums the ranks'
    per-token MTP losses as they are: before 0.19)."""
    from kit.mtp_context_parallel import assert_mtp_exact

    assert_mtp_exact([rank["cp2-mla-moe-mtp"] for rank in world], "zigzag")


@layouts.mark("mtp", "cp2-zigzag", "pp2")
def test_mtp_beside_context_parallelism_and_pipeline_stages_equals_megatron_cores_own_path(world):
    """MTP at CP = 2 x PP = 2 through megatron-core's schedule (the block on the last stage): the plan
    against megatron-core's own packed path at the same layout and weights, on every rank: the main loss
    per micro-batch, the MTP loss each rank logs, every gradient summed over the CP ranks, and each
    micro-batch's MTP layer running this rank's half of the depth's stream."""
    from kit.mtp_context_parallel import GRAD_TOL, TOL

    if not world[0]["cp2-pp2-mtp"]:
        pytest.skip("megatron-core < 0.16 refuses a plan at context parallelism by name (0.13: MTP refuses packed "
                    "input)")
    assert [rank["cp2-pp2-mtp"]["last"] for rank in world] == [False, False, True, True]
    for rank in world:
        checks = rank["cp2-pp2-mtp"]
        assert checks["loss"] < TOL and checks["mtp"] < TOL and checks["grads"] < GRAD_TOL, checks
        assert checks["rows"] == checks["expected"] and checks["micro_batches"] == (2 if checks["last"] else 0)



@layouts.mark("cp2-zigzag", "cp2-allgather", "tp2", "sp")
def test_context_parallel_ranks_given_ids_cut_in_different_layouts_are_told_so_alike(world):
    """CP rank 0 passes its zigzag share, rank 1 its contiguous one (each checked against its own layout):
    a ValueError on all four ranks before the plan's first collective, never rows read wrong."""
    if not world[0]["cp2-tp2-sp"]:
        pytest.skip("megatron-core < 0.16 refuses a plan at context parallelism by name")
    for rank in world:  # each told by its own context-parallel group (two of them beside TP = 2)
        message = rank["cp2-tp2-sp"].get(("mixed", -1))
        assert message is not None and "cp_layout differs between the ranks of the context-parallel group" in message
        assert "zigzag" in message and "contiguous" in message


def test_a_layers_own_share_reads_its_group_and_the_layout_its_ids_were_cut_in(world):
    """`context_parallel_group` / `group_share` (slime's gated delta net layers' seam at CP > 1): the
    module's own CP group where it names one, else megatron-core's, none at CP size 1; each CP rank's
    share in the layout its ids were cut in, over the CP group (2 ranks beside TP = 2, not the world's
    4); the stream gathered from every rank's rows in order, each rank's gradient the sum of every
    rank's on its own rows; every logical row found in the ranks' rows gathered, in each layout;
    ranks cut in different layouts refused alike, naming the layouts and the group."""
    from kit.shared_prefix import grpo_batch

    from megatron_rl_patches.ops.context_rows import local_rows

    bounds = grpo_batch(((33, (3, 7)), (21, (3, 7, 11))), (), padding=8, seed=1).cu_seqlens  # share_checks' batch
    for index, rank in enumerate(world):
        found = rank["cp2-tp2-shares"]
        cp = found["cp ranks"]
        assert len(cp) == 2 and (found["its own group"], found["megatron's group"], found["one rank"]) == (
            [0, 1, 2, 3], cp, None)
        mine = cp.index(index)
        for layout in ("zigzag", "contiguous"):
            want = local_rows(layout, mine, 2, cu_seqlens=bounds).tolist()
            assert found[layout] == (2, mine, layout, want, cp)
        assert found["no group"] is None
        assert found["gathered"] == (True, True) and found["positions taken"]  # the stream, its gradient summed
        assert found["zigzag order"] and found["contiguous order"]
        said = f"rank {cp[0]}: zigzag, rank {cp[1]}: contiguous"  # CP rank 0 cut zigzag, CP rank 1 contiguous
        assert found["mixed"] == (
            "a shared-prefix plan's context-parallel layout (shared_prefix_params' cp_layout): cp_layout differs "
            f"between the ranks of the context-parallel group {cp} ({said}): pass the same cp_layout on every rank")
