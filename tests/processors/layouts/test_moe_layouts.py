"""MoE models in the kit (experts, top-k routing, the allgather dispatcher) and the fused output
processors on them: at EP=1 in-process; at EP=2 (against the EP=1 model with the same experts),
and through `inference_forward` at PP=2, in one 2-rank gloo world; at EP=2 also the divergence
processor against the dense float64 route. `inference_forward` with a
processor on an MoE model used to crash on megatron-core 0.13-0.17 (the schedule reads
`output_tensor.device` when `num_moe_experts` is set; a plain dict has none) and, pipelined,
leave the other stages waiting in p2p."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error
from megatron_rl_patches.testing.multirank import run_multirank

pytestmark = pytest.mark.megatron
REL = 2e-6
REL_DIVERGENCE = 5e-5  # the fp32 divergence against the float64 dense route
SEQ = 16
EP = PP = 2
WORLD = 4  # EP=2 x expert-DP=2; PP=2 x DP=2; PP=2 x EP=2




def _forward(model, batch, **kwargs):
    return model(batch["tokens"], batch["position_ids"], batch["attention_mask"], **kwargs)


def _logits_path(model, batch):
    """log p(label) and entropy per token [b, s] from the model's logits."""
    from megatron_rl_patches import log_probs_and_entropy

    logits = _forward(model, batch)
    lp, ent = log_probs_and_entropy(logits.reshape(-1, logits.size(-1)), batch["labels"].reshape(-1),
                                    with_entropy=True)
    return lp.view_as(batch["labels"]), ent.view_as(batch["labels"])


def _fused_path(model, batch):
    from megatron_rl_patches import log_prob_output_processor

    out = _forward(model, batch, labels=batch["labels"], output_processor=log_prob_output_processor(with_entropy=True))
    return out["log_probs"], out["entropy"]


def _scored_grads(model, path, batch, weights) -> tuple[dict, torch.Tensor]:
    """Gradients of sum(w * (log_prob + entropy / 2)) along `path`, and the log-probs."""
    lp, ent = path(model, batch)
    (weights * (lp + 0.5 * ent)).sum().backward()
    return collect_grads(model), lp.detach()


def _inference_step(processor):
    def step(iterator, model):
        batch = next(iterator)
        if processor is None:  # the logits path: token_log_probs collects from logits and targets
            return _forward(model, batch), batch["labels"]
        return _forward(model, batch, labels=batch["labels"], output_processor=processor)

    return step


def _outputs_from_logits(logits, labels) -> dict:
    """What the processors return, computed from the logits: log-probs, entropy, top-3 buckets."""
    from megatron_rl_patches import topk_ids, topk_logprobs
    from megatron_rl_patches.inference import token_log_probs

    out = token_log_probs(with_entropy=True)(logits, labels)
    rows = logits.reshape(-1, logits.size(-1))
    ids = topk_ids(rows, 3)
    log_probs, tail = topk_logprobs(rows, ids)
    out.update(topk_ids=ids.view(*labels.shape, 3), topk_log_probs=log_probs.view(*labels.shape, 3),
               tail=tail.view_as(labels))
    return out


def _inference_routes(chunks, batches) -> dict:
    """inference_forward over `batches` by the logits path and by the log-prob and top-k processors."""
    from megatron_rl_patches import log_prob_output_processor, topk_output_processor
    from megatron_rl_patches.inference import inference_forward

    def run(processor, collect=None):
        return inference_forward(chunks, iter(batches), _inference_step(processor), num_microbatches=len(batches),
                                 seq_length=SEQ, micro_batch_size=batches[0]["tokens"].size(0), collect=collect)

    return {
        "logits": run(None, _outputs_from_logits),
        "log_prob": run(log_prob_output_processor(with_entropy=True)),
        "topk": run(topk_output_processor(k=3)),
    }


def _compare_routes(routes: dict) -> dict:
    """Fused inference results (log-probs, entropy, top-k buckets) against the logits path."""
    collected = [len(r) for r in routes.values()]
    if not routes["logits"]:  # not the last pipeline stage: nothing collected
        return {"collected": collected}
    pairs = {"log_probs": "log_prob", "entropy": "log_prob", "topk_log_probs": "topk", "tail": "topk"}
    figures = {key: max(relative_error(f[key], r[key]) for f, r in zip(routes[route], routes["logits"]))
               for key, route in pairs.items()}
    figures["topk_ids"] = float(not all(torch.equal(f["topk_ids"], r["topk_ids"])
                                        for f, r in zip(routes["topk"], routes["logits"])))
    return {"collected": collected, **figures}


# ------------------------------------------------------------------------------------- one rank

@layouts.mark("moe", "ep1")
def test_moe_fused_equals_logits_path_values_and_grads(megatron_cpu, clean_patch_state):
    import megatron_rl_patches
    from megatron_rl_patches.testing.moe_gpt import build_tiny_moe_gpt

    megatron_rl_patches.apply(only="gpt_output_processor")
    model = build_tiny_moe_gpt(seed=1)
    assert sum("local_experts" in name for name, _ in model.named_parameters()) == 2 * 4 * 2  # layers x experts x fc
    batch = megatron_cpu.batch(seed=2)
    weights = torch.randn(2, SEQ, generator=torch.Generator().manual_seed(3))
    want, want_lp = _scored_grads(model, _logits_path, batch, weights)
    got, got_lp = _scored_grads(model, _fused_path, batch, weights)
    assert got.keys() == want.keys() and any("local_experts" in name for name in got)
    assert relative_error(got_lp, want_lp) <= REL
    assert max(relative_error(got[n], want[n]) for n in want) <= REL
    with torch.no_grad():  # negative control: the comparison sees the experts' weights
        model.decoder.layers[0].mlp.experts.local_experts[0].linear_fc2.weight.mul_(3.0)
        changed, _ = _fused_path(model, batch)
    assert relative_error(changed, want_lp) > 1e-3


@layouts.mark("moe", "ep1")
def test_moe_inference_forward_with_processors(megatron_cpu, clean_patch_state):
    """The crash: megatron-core 0.13-0.17 read `.device` off the processor's dict."""
    import megatron_rl_patches
    from megatron_rl_patches.testing.moe_gpt import build_tiny_moe_gpt

    megatron_rl_patches.apply(only="gpt_output_processor")
    model = build_tiny_moe_gpt(seed=1)
    batches = [megatron_cpu.batch(seed=s) for s in (4, 5)]
    figures = _compare_routes(_inference_routes([model], batches))
    assert figures.pop("collected") == [2, 2, 2]
    assert max(figures.values()) <= REL, figures


def test_processor_output_carries_device_and_dtype():
    from megatron_rl_patches.processors.output import ProcessorOutput

    out = ProcessorOutput(entropy=None, log_probs=torch.zeros(2, 3, dtype=torch.float64))
    assert out.device == torch.device("cpu") and out.dtype == torch.float64 and dict(out) == dict(out.items())
    with pytest.raises(AttributeError, match="no tensor"):
        ProcessorOutput(entropy=None).device  # noqa: B018


# ----------------------------------------------------------------------------------- two ranks

def _ep2_checks(rank: int) -> dict:
    """EP=2 × expert-DP=2 (experts 2e, 2e+1 on expert rank e) against the EP=1 model with the same
    weights, each rank scoring its own batch: log-probs, dense grads per rank, expert grads summed
    over the expert group (the allgather dispatcher brings its ranks' tokens to each expert);
    fused = logits at EP=2, also through inference_forward; real DDP reduces over DP and expert-DP."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_rl_patches.testing.megatron_cpu import make_batch, megatron_on_cpu
    from megatron_rl_patches.testing.moe_gpt import build_tiny_moe_gpt, global_expert_name, tiny_moe_config

    batch = make_batch(seed=10 + rank)
    weights = torch.randn(2, SEQ, generator=torch.Generator().manual_seed(20 + rank))
    with megatron_on_cpu(expert_parallel=1):
        reference = build_tiny_moe_gpt(seed=1)
        ref_grads, ref_lp = _scored_grads(reference, _logits_path, batch, weights)
        state = {name: p.detach().clone() for name, p in reference.named_parameters()}
        mean_grads = {}  # the gradient of the mean over all ranks' objectives (what DDP reduces to)
        for name, grad in ref_grads.items():
            mean_grads[name] = grad.clone()
            dist.all_reduce(mean_grads[name])
            mean_grads[name] /= dist.get_world_size()
    out: dict = {}
    with megatron_on_cpu(expert_parallel=EP):
        expert_rank = parallel_state.get_expert_model_parallel_rank()
        for name, grad in ref_grads.items():
            if "local_experts" in name:
                dist.all_reduce(grad, group=parallel_state.get_expert_model_parallel_group())
        model = build_tiny_moe_gpt(tiny_moe_config(expert_parallel=EP), seed=1)
        per_rank = 4 // EP
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(state[global_expert_name(name, expert_rank, per_rank)])
        for label, path in (("logits", _logits_path), ("fused", _fused_path)):
            grads, lp = _scored_grads(model, path, batch, weights)
            out[label] = {
                "log_probs": relative_error(lp, ref_lp),
                "grads": max(relative_error(g, ref_grads[global_expert_name(n, expert_rank, per_rank)])
                             for n, g in grads.items()),
                "experts": sum("local_experts" in n for n in grads),
            }
        batches = [make_batch(seed=30 + 2 * rank + i) for i in range(2)]
        out["inference"] = _compare_routes(_inference_routes([model], batches))
        out["divergence"] = _divergence_checks(model, batch, weights)
        out["ddp"] = _ddp_reduced_error(model, batch, weights, mean_grads, expert_rank, per_rank)
        with torch.no_grad():  # negative control: expert rank 1's experts change what rank 0 scores too
            for name, param in model.named_parameters():
                if "local_experts" in name and expert_rank == 1:
                    param.mul_(3.0)
            changed, _ = _fused_path(model, batch)
        out["changed experts"] = relative_error(changed, ref_lp)
    return out


def _divergence_checks(model, batch, weights) -> dict:
    """The divergence processor (jsd from a teacher given by its hidden states and output weight)
    on the EP=2 model against the dense float64 route on its logits: values and every gradient;
    "beta" (the dense route at another beta) is the negative control."""
    from megatron_rl_patches import divergence_output_processor
    from megatron_rl_patches.testing.divergence_reference import dense_divergence

    gen = torch.Generator().manual_seed(50)
    hidden, teacher_weight = torch.randn(2, SEQ, 32, generator=gen), torch.randn(64, 32, generator=gen) / 4
    teacher_rows = (hidden.reshape(-1, 32) @ teacher_weight.T).double()

    def run(fused: bool, beta: float = 0.4):
        if fused:
            values = _forward(model, batch, output_processor=divergence_output_processor(divergence="jsd", beta=beta),
                              output_processor_context={"teacher_hidden": hidden, "teacher_weight": teacher_weight})
        else:
            rows = _forward(model, batch).reshape(-1, 64).double()
            values = dense_divergence(rows, [teacher_rows], divergence="jsd", beta=beta).view_as(weights)
        (weights * values).sum().backward()
        return values.detach().double(), collect_grads(model)

    want, want_grads = run(False)
    got, grads = run(True)
    _, beta_grads = run(False, beta=0.6)
    return {"values": relative_error(got, want), "grads": grad_error(grads, want_grads),
            "beta": grad_error(beta_grads, want_grads)}


def _ddp_reduced_error(model, batch, weights, mean_grads: dict, expert_rank: int, per_rank: int) -> float:
    """Real DDP around the EP=2 model (expert data parallel = 2): after finish_grad_sync the dense
    gradients are averaged over the 4 data-parallel ranks and the experts' over their expert-DP
    group, so every main_grad is the gradient of the mean objective of all ranks."""
    from megatron_rl_patches.testing.megatron_cpu import wrap_ddp
    from megatron_rl_patches.testing.moe_gpt import global_expert_name

    ddp = wrap_ddp(model)
    ddp.zero_grad_buffer()
    lp, ent = _fused_path(ddp, batch)
    (weights * (lp + 0.5 * ent)).sum().backward()
    ddp.finish_grad_sync()
    return max(relative_error(p.main_grad, mean_grads[global_expert_name(n, expert_rank, per_rank)])
               for n, p in model.named_parameters())


def _pipelined_checks(rank: int, expert_parallel: int) -> dict:
    """inference_forward through PP=2 (× `expert_parallel`) on an MoE model: the last stage
    collects what the logits path gives, no stage hangs."""
    from megatron.core import parallel_state

    from megatron_rl_patches.testing.megatron_cpu import make_batch, megatron_on_cpu
    from megatron_rl_patches.testing.moe_gpt import build_tiny_moe_gpt, tiny_moe_config

    with megatron_on_cpu(pipeline_parallel=PP, expert_parallel=expert_parallel):
        config = tiny_moe_config(pipeline_model_parallel_size=PP, expert_parallel=expert_parallel)
        chunk = build_tiny_moe_gpt(config, seed=1, pre_process=parallel_state.is_pipeline_first_stage(),
                                   post_process=parallel_state.is_pipeline_last_stage())
        data_rank = parallel_state.get_data_parallel_rank()
        batches = [make_batch(seed=40 + 10 * data_rank + i) for i in range(3)]
        result = _compare_routes(_inference_routes([chunk], batches))
        result["last stage"] = parallel_state.is_pipeline_last_stage()
        return result


def _moe_world(rank: int, world_size: int) -> dict:
    import megatron_rl_patches

    megatron_rl_patches.apply(only="gpt_output_processor")
    return {"ep2": _ep2_checks(rank), "pp2": _pipelined_checks(rank, 1), "pp2ep2": _pipelined_checks(rank, EP)}


@pytest.fixture(scope="module")
def moe_world() -> list[dict]:
    return run_multirank(_moe_world, WORLD, timeout=300)


@pytest.mark.multirank
@pytest.mark.slow
@layouts.mark("moe", "ep2")
def test_ep2_equals_ep1_and_fused_equals_logits(moe_world):
    for result in moe_world:
        ep2 = result["ep2"]
        for label in ("logits", "fused"):
            assert ep2[label]["experts"] == 2 * 2 * 2  # layers x local experts x fc
            assert max(ep2[label]["log_probs"], ep2[label]["grads"]) <= REL, (label, ep2[label])
        assert ep2["ddp"] <= REL, ep2["ddp"]
        figures = dict(ep2["inference"])
        assert figures.pop("collected") == [2, 2, 2]
        assert max(figures.values()) <= REL, figures
    assert moe_world[0]["ep2"]["changed experts"] > 1e-3  # rank 0 sees rank 1's experts


@pytest.mark.multirank
@pytest.mark.slow
@layouts.mark("moe", "ep2")
def test_ep2_divergence_processor_equals_the_dense_route(moe_world):
    for result in moe_world:
        divergence = result["ep2"]["divergence"]
        assert max(divergence["values"], divergence["grads"]) <= REL_DIVERGENCE, divergence
        assert divergence["beta"] > 1e-4, divergence  # the comparison sees another beta


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("layout", [pytest.param("pp2", marks=layouts.mark("moe", "pp2")),
                                    pytest.param("pp2ep2", marks=layouts.mark("moe", "pp2", "ep2"))])
def test_pipelined_moe_inference_forward_with_processors(moe_world, layout):
    results = [result[layout] for result in moe_world]
    assert [r.pop("last stage") for r in results] == [False, False, True, True]  # order tp-cp-ep-dp-pp
    for result in results[:2]:
        assert result == {"collected": [0, 0, 0]}
    for result in results[2:]:
        assert result.pop("collected") == [3, 3, 3]
        assert max(result.values()) <= REL, result
