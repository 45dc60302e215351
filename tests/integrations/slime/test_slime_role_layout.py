"""A role at its own layout (issue 58 item 1) in the 2-rank gloo world the teacher-layout checks
share (`layout_worlds.two_rank_world`, spawned once): the student at TP=1 x DP=2, the stand-in
slime's `initialize_model_and_optimizer` and `forward_only` patched by `inference_roles`, the role
written `prm_teacher;tp=2` in MEGATRON_RL_PATCHES_INFERENCE_ROLES. The role (a Hugging Face
directory of another architecture than the actor's) is built at TeacherLayout(tp=2); slime's
log-prob pass of it never reaches slime's schedule (the stand-in raises there) and gives each rank
(other counts, lengths and micro-batch counts than the other's; slime's dynamic-batch order) the
log-probs and entropy of the same role built at the student's layout on its response rows (1e-6,
relative 1e-6). A world the size does not divide, a role of the actor's architecture (slime's own
route), a pass other than the log-prob one and rollout top-p replay are refused by name on both ranks, the world usable
after; the role at the student's layout still goes to slime's own forward_only."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.inference.teacher_layout.layout_worlds import close, served, two_rank_world

pytestmark = [pytest.mark.megatron, pytest.mark.multirank, pytest.mark.slow]

STANDINS = str(Path(__file__).resolve().parents[2] / "standins")
VOCAB, TEMPERATURE = 1001, 0.8
# per rank: each sample's (total length, response length), and slime's micro-batch indices (dynamic order)
SAMPLES = (((9, 4), (6, 3)), ((12, 5), (7, 2), (10, 6)))
MICRO_BATCHES = ([[1, 0]], [[2], [0, 1]])


class DataIterator:
    """slime's DataIterator (slime/backends/megatron_utils/data.py, 624b824a): the per-sample
    fields of one rank's rollout, handed out by micro-batch indices."""

    def __init__(self, rollout_data: dict, micro_batch_indices: list[list[int]]):
        self.rollout_data, self.micro_batch_indices, self.offset = rollout_data, micro_batch_indices, 0

    def get_next(self, keys):
        indices = self.micro_batch_indices[self.offset]
        self.offset += 1
        return {key: None if self.rollout_data.get(key) is None else [self.rollout_data[key][i] for i in indices]
                for key in keys}

    def reset(self):
        self.offset = 0
        return self


def _rollout(rank: int) -> dict:
    gen = torch.Generator().manual_seed(40 + rank)
    return {"tokens": [torch.randint(0, VOCAB, (total,), generator=gen) for total, _ in SAMPLES[rank]],
            "total_lengths": [t for t, _ in SAMPLES[rank]], "response_lengths": [r for _, r in SAMPLES[rank]]}


def _reference(chunks, data: dict) -> tuple[list, list]:
    """Per sample, the role built at the student's layout (whole on this rank): log p(response token)
    and the entropy at its response rows, float64 over the real vocab."""
    logps, entropies = [], []
    for tokens, response in zip(data["tokens"], data["response_lengths"]):
        n = tokens.numel()
        causal = torch.ones(n, n, dtype=torch.bool).tril().logical_not()[None, None]
        with torch.no_grad():
            logits = chunks[0](tokens[None], torch.arange(n)[None], causal)[0, :, :VOCAB].double() / TEMPERATURE
        logp = torch.log_softmax(logits, -1)[n - response - 1: n - 1]
        logps.append(logp.gather(-1, tokens[n - response:, None])[:, 0])
        entropies.append(-(logp.exp() * logp).sum(-1))
    return logps, entropies


def _refusal(call) -> str | None:
    try:
        call()
    except ValueError as exc:
        return str(exc)
    return None


def get_values(logits, **_):  # the critic's forward_only callback, by slime's name
    raise AssertionError("never called")


def role_checks(rank: int, world_size: int, root: str) -> dict:
    import sys

    import torch.distributed as dist

    if STANDINS not in sys.path:
        sys.path.insert(0, STANDINS)
    import slime.backends.megatron_utils.loss as slime_loss
    import slime.backends.megatron_utils.model as slime_model

    import megatron_rl_patches
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu
    from tests.integrations.slime.tiny_actor import tiny_actor_args

    results: dict = {}
    args = tiny_actor_args(num_layers=3, prm_teacher_load=root, load=None, rollout_temperature=TEMPERATURE,
                           use_rollout_entropy=True, use_dynamic_batch_size=True,
                           custom_megatron_before_log_prob_hook_path=None)
    data = _rollout(rank)

    def role(entry: str, run_args=args):
        os.environ["MEGATRON_RL_PATCHES_INFERENCE_ROLES"] = entry
        return slime_model.initialize_model_and_optimizer(run_args, role="prm_teacher")

    def log_probs(model, f=slime_loss.get_log_probs_and_entropy, top_p=False):
        iterator = DataIterator(data, MICRO_BATCHES[rank])
        return slime_model.forward_only(f, args, model, [iterator], [len(MICRO_BATCHES[rank])], store_prefix="prm_",
                                        use_rollout_top_p_replay=top_p)

    with megatron_on_cpu():  # the student: TP=1 x DP=2
        megatron_rl_patches.apply(only="inference_roles", strict=True)
        try:
            results["tp4"] = _refusal(lambda: role("prm_teacher;tp=4"))
            results["snapshot"] = _refusal(lambda: role("prm_teacher;tp=2", tiny_actor_args(prm_teacher_load=root)))
            try:
                model, optimizer, scheduler, iteration = role("prm_teacher;tp=2")
            except ValueError as exc:  # a megatron-core without ProcessGroupCollection
                results["unsupported"] = str(exc)
                dist.barrier()
                return results
            results["built"] = (model[0].role, optimizer, scheduler, iteration, model[0].teacher_groups.tp_size,
                                any(p.requires_grad for p in model[0].parameters()))
            results["scores"] = log_probs(model)
            # the same pass with NCCL and a GPU faked as the device rule reads them (its own test module)
            from tests.integrations.slime.test_slime_layout_teacher_nccl_device import nccl_on_a_gpu

            results["nccl_records"] = []
            with nccl_on_a_gpu(results["nccl_records"]):
                results["nccl_scores"] = log_probs(model)
            # the same role streamed (each rank's own shard in host memory, layer by layer)
            streamed, *_ = role("prm_teacher:stream;tp=2")
            results["stream_scores"] = log_probs(streamed)
            results["stream_report"] = megatron_rl_patches.residency_report(streamed).as_dict()
            results["values"] = _refusal(lambda: log_probs(model, get_values))
            results["top_p"] = _refusal(lambda: log_probs(model, top_p=True))
            whole, *_ = role("prm_teacher")  # the same role at the student's layout
            try:
                log_probs(whole)
            except LookupError as exc:  # the stand-in's forward_only: slime's own pass, not ours
                results["whole_pass"] = type(exc).__name__
            results["ref_log_probs"], results["ref_entropy"] = _reference(whole, data)
        finally:
            megatron_rl_patches.revert()
            os.environ.pop("MEGATRON_RL_PATCHES_INFERENCE_ROLES", None)
        dist.barrier()  # every rank got here: nothing above left a rank waiting
    return results


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return two_rank_world(tmp_path_factory, "role")


def test_each_rank_gets_the_log_probs_and_entropy_of_the_role_at_the_students_layout(world):
    served(world)
    for rank, result in enumerate(world):
        assert result["built"] == ("prm_teacher", None, None, 0, 2, False)
        scores = result["scores"]
        assert sorted(scores) == ["prm_entropy", "prm_log_probs"]
        assert [tuple(t.shape) for t in scores["prm_log_probs"]] == [(r,) for _, r in SAMPLES[rank]]
        for key in ("log_probs", "entropy"):
            for got, want in zip(scores[f"prm_{key}"], result[f"ref_{key}"]):
                assert close(got.double(), want) <= 1e-6, (rank, key, close(got.double(), want))
        assert result["whole_pass"] == "StandInOnly"


def test_a_streamed_role_at_its_own_layout_gives_the_resident_roles_results_bit_for_bit(world):
    """`prm_teacher:stream;tp=2`: slime's log-prob pass of the role streamed at TeacherLayout(tp=2)
    equals the resident role's at that layout (torch.equal); each rank holds its shard in host
    memory and nothing on the device after the pass."""
    served(world)
    for rank, result in enumerate(world):
        assert sorted(result["stream_scores"]) == sorted(result["scores"])
        for key, values in result["scores"].items():
            assert all(torch.equal(got, want) for got, want in zip(result["stream_scores"][key], values, strict=True))
        report = result["stream_report"]
        assert report["mode"] == "stream" and report["device_weight_bytes"] == 0, rank
        assert report["host_bytes"] == report["resident_weight_bytes"] > 0, rank  # this rank's shard, no more


def test_what_a_role_at_its_own_layout_cannot_serve_is_refused_on_every_rank(world):
    for result in world:
        assert "MEGATRON_RL_PATCHES_INFERENCE_ROLES role 'prm_teacher;tp=4': ';tp=4' cannot be laid over 2 rank(s)" \
            in result["tp4"]
        assert "role 'prm_teacher;tp=2': its weights" in result["snapshot"]
        assert "go slime's own route" in result["snapshot"]
        if "unsupported" in result:  # 0.13.1: refused by name before the role loads
            assert "needs megatron-core's ProcessGroupCollection" in result["unsupported"]
            continue
        assert "slime's forward_only with get_values: a role at its own layout serves slime's log-prob pass" \
            in result["values"]
        assert "rollout top-p replay (the rollout's kept ids) is not served for a role at its own layout" \
            in result["top_p"]
