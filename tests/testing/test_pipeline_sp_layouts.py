"""The kit's sequence-parallel, pipeline and virtual-pipeline worlds (one 2-rank gloo world for the
module) with the fused log-prob processor against the logits path, values and every gradient:
- TP=2 + SP on a real GPTModel (the kit's norm shim marks the norms `sequence_parallel`): also
  against the same model without SP, its norm gradients summed over the TP group as
  `finalize_model_grads` does (unsummed, they differ: the negative control);
- PP=2 and PP=2 × VPP=2 through megatron-core's real schedule; the negative control shifts the
  labels, and the first stage's gradients see it across the p2p boundary."""
from __future__ import annotations

import pytest

from megatron_rl_patches.testing.multirank import run_multirank

pytestmark = [pytest.mark.megatron, pytest.mark.multirank, pytest.mark.slow]
REL = 2e-6
MICRO_BATCHES = 4


def _error(got, want) -> float:
    return float((got - want).abs().max()) / max(1.0, float(want.abs().max()))


def _grads(model) -> dict:
    out = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out


def _grad_error(got: dict, want: dict) -> float:
    assert got.keys() == want.keys() and got, (sorted(got), sorted(want))
    return max(_error(got[name], want[name]) for name in want)


def _scores(route: str, model, batch, tp_group=None):
    """(log-probs, entropy) [b, s] by the logits path or the fused processor."""
    import torch

    from megatron_rl_patches import log_prob_output_processor, log_probs_and_entropy

    labels = batch["labels"]
    if route == "wrong labels":
        route, labels = "fused", torch.roll(labels, 1, dims=1)
    args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    if route == "fused":
        out = model(*args, labels=labels, output_processor=log_prob_output_processor(with_entropy=True))
        return out
    logits = model(*args)
    if not model.post_process:
        return logits  # a stage before the last: its hidden states go on to the next stage
    lp, ent = log_probs_and_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), tp_group=tp_group,
                                    with_entropy=True)
    return {"log_probs": lp.view_as(labels), "entropy": ent.view_as(labels)}


def _objective(scores: dict, weights):
    return (weights * (scores["log_probs"] + 0.5 * scores["entropy"])).sum()


def _sp_checks(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_rl_patches.testing.megatron_cpu import make_batch, megatron_on_cpu

    out: dict = {}
    with megatron_on_cpu(tensor_parallel=world_size) as env:
        tp = parallel_state.get_tensor_model_parallel_group()
        batch = make_batch(seed=3)
        weights = torch.randn(2, 16, generator=torch.Generator().manual_seed(4))
        plain = env.gpt(env.config(tensor_model_parallel_size=world_size), seed=5)
        sp = env.gpt(env.config(tensor_model_parallel_size=world_size, sequence_parallel=True), seed=5)
        marked = sorted(n for n, p in sp.named_parameters() if getattr(p, "sequence_parallel", False))
        out["marked"] = marked
        results = {}
        for label, model, route in (("plain", plain, "logits"), ("logits", sp, "logits"), ("fused", sp, "fused")):
            scores = _scores(route, model, batch, tp)
            _objective(scores, weights).backward()
            results[label] = (scores["log_probs"].detach(), _grads(model))
        summed = {name: grad.clone() for name, grad in results["logits"][1].items()}
        for name in marked:
            dist.all_reduce(summed[name], group=tp)
        out["fused vs logits"] = (_error(results["fused"][0], results["logits"][0]),
                                  _grad_error(results["fused"][1], results["logits"][1]))
        out["sp vs plain"] = (_error(results["logits"][0], results["plain"][0]),
                              _grad_error(summed, results["plain"][1]))
        out["unsummed norms"] = _grad_error(results["logits"][1], results["plain"][1])
    return out


def _pipeline_step(route: str):
    def step(iterator, model):
        batch = next(iterator)
        output = _scores(route, model, batch)

        def loss_func(scores):
            return _objective(scores, batch["weights"]), {"log_probs": scores["log_probs"].detach()}

        return output, loss_func

    return step


def _pipeline_checks(rank: int, world_size: int, virtual: int | None) -> dict:
    import torch

    from megatron_rl_patches.testing.megatron_cpu import make_batch, megatron_on_cpu, run_schedule, tiny_provider
    from megatron_rl_patches.testing.pipeline import is_last_stage, pipeline_chunks, tiny_pipeline_config

    batches = []
    for i in range(MICRO_BATCHES):
        batch = make_batch(seed=60 + i)
        batch["weights"] = torch.randn(2, 16, generator=torch.Generator().manual_seed(70 + i))
        batches.append(batch)
    with megatron_on_cpu(pipeline_parallel=world_size, virtual_pipeline=virtual):
        config = tiny_pipeline_config(world_size, virtual)
        chunks = pipeline_chunks(tiny_provider("gpt", config, seed=6))
        runs = {}
        for route in ("logits", "fused", "wrong labels"):
            reported = run_schedule(chunks, batches, _pipeline_step(route))
            grads: dict = {}
            for j, chunk in enumerate(chunks):
                grads.update({f"{j}.{name}": g for name, g in _grads(chunk).items()})
            runs[route] = (torch.cat([r["log_probs"] for r in reported]) if reported else None, grads)
        last = is_last_stage()
        out = {"last": last, "chunks": len(chunks),
               "grads": _grad_error(runs["fused"][1], runs["logits"][1]),
               "wrong labels grads": _grad_error(runs["wrong labels"][1], runs["logits"][1])}
        if last:
            out["log_probs"] = _error(runs["fused"][0], runs["logits"][0])
            out["wrong labels"] = _error(runs["wrong labels"][0], runs["logits"][0])
        return out


def _layouts_world(rank: int, world_size: int) -> dict:
    import megatron_rl_patches

    megatron_rl_patches.apply(only="gpt_output_processor")
    return {"sp": _sp_checks(rank, world_size), "pp2": _pipeline_checks(rank, world_size, None),
            "vpp": _pipeline_checks(rank, world_size, 2)}


@pytest.fixture(scope="module")
def layouts_world() -> list[dict]:
    return run_multirank(_layouts_world, 2, timeout=300)


@pytest.mark.layout("tp2", "sp")
def test_sequence_parallel_gpt_fused_equals_logits_and_plain_tp(layouts_world):
    for result in layouts_world:
        sp = result["sp"]
        norms = [name for name in sp["marked"] if "layernorm" in name]
        assert len(norms) == 2 * (2 * 2 + 1)  # weight and bias of 2 norms per layer and the final norm
        assert max(sp["fused vs logits"]) <= REL, sp["fused vs logits"]
        assert max(sp["sp vs plain"]) <= REL, sp["sp vs plain"]
        assert sp["unsummed norms"] > 1e-3  # negative control: each SP rank saw half the sequence


@pytest.mark.parametrize("layout", [pytest.param("pp2", marks=pytest.mark.layout("pp2")),
                                    pytest.param("vpp", marks=pytest.mark.layout("pp2", "vpp2"))])
def test_pipelined_fused_equals_logits_through_the_schedule(layouts_world, layout):
    results = [result[layout] for result in layouts_world]
    assert [r["last"] for r in results] == [False, True]
    for result in results:
        assert result["chunks"] == (2 if layout == "vpp" else 1)
        assert result["grads"] <= REL, result
        assert result["wrong labels grads"] > 1e-3, result  # the first stage sees the last stage's loss
    assert results[1]["log_probs"] <= REL and results[1]["wrong labels"] > 1e-3, results[1]
