"""The kit's CPU context-parallel attention at CP=2 (one gloo world of 2 ranks for the module):
against megatron-core's own local DotProductAttention on the full sequence at CP=1 (values and the
gradients of query, key and value), in both layouts (zigzag, contiguous = slime's allgather-cp),
`bshd` and packed `thd`; then a CP=2 GPTModel trains (per-token losses and every parameter's
gradient) and scores through the fused log-prob processor like the CP=1 model, and the top-k
processor on each rank's rows equals the CP model's logits path (ids, values, gradients), the
divergence processor from a CP teacher the dense float64 divergence (values, gradients); the
resident, swap and stream inference builds of the CP model, and layer-major scoring of a stream
build, give its logits bit for bit.
Negative controls: rows in the wrong chunk order give a different answer; the top-k processor at
another temperature, the divergence at another beta too."""
from __future__ import annotations

import pytest
from kit.builds import each_residency

from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error
from megatron_rl_patches.testing.multirank import run_multirank

pytestmark = [pytest.mark.megatron, pytest.mark.multirank, pytest.mark.slow]

CP = 2
TOPK = 4
REL = 1e-5  # fp32 rounding against the CP=1 reference
REL_DIVERGENCE = 5e-5  # the fp32 divergence of small values against the float64 dense route
PACKED = [8, 12, 4]  # each a multiple of 2*CP: zigzag cuts every sequence into 2*CP chunks
CASES = ("zigzag-bshd", "contiguous-bshd", "zigzag-thd", "contiguous-thd")
# megatron-core's RoPE takes each rank's positions in the zigzag layout (bshd and thd alike)
GPT_CASES = (*CASES, "zigzag-bshd-rope", "zigzag-thd-rope")




def _attention_checks(env, rank: int) -> dict:
    """ContextParallelAttention at CP=2 against megatron-core's DotProductAttention at CP=1."""
    import torch
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    reference = DotProductAttention(env.config(num_query_groups=2), 1, AttnMaskType.causal, "self")
    config = env.config(num_query_groups=2, context_parallel_size=CP)
    gen = torch.Generator().manual_seed(0)
    seq, batch, heads, groups, dim = 16, 2, 4, 2, 8
    cu = torch.tensor([0, *torch.tensor(PACKED).cumsum(0).tolist()], dtype=torch.int32)
    results = {}
    for case in CASES:
        layout, form = case.split("-")
        packed = form == "thd"
        rows, b = (sum(PACKED), 1) if packed else (seq, batch)
        q = torch.randn(rows, b, heads, dim, generator=gen)
        k, v = (torch.randn(rows, b, groups, dim, generator=gen) for _ in range(2))
        grad_out = torch.randn(rows, b, heads * dim, generator=gen)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if packed:  # the reference: the local attention on each sequence alone
            bounds = cu.tolist()
            want = torch.cat([reference(*(t[s:e] for t in leaves), None) for s, e in zip(bounds[:-1], bounds[1:])])
        else:
            want = reference(*leaves, None)
        want.backward(grad_out)

        where = cu if packed else None
        got = _run_cp_attention(config, rank, (q, k, v), grad_out, layout, layout, where)
        results[case] = [relative_error(g, w) for g, w in zip(got, [want, *(t.grad for t in leaves)])]
        other = "contiguous" if layout == "zigzag" else "zigzag"
        results[case + " wrong order"] = relative_error(
            _run_cp_attention(config, rank, (q, k, v), grad_out, other, layout, where)[0], want)
    return results


def _run_cp_attention(config, rank: int, full: tuple, grad_out, split_layout: str, attention_layout: str, cu):
    """The CP attention's output and query/key/value gradients, rows split in `split_layout` and
    gathered back as `attention_layout` (the same, unless the negative control swaps them)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl_patches.testing.cp_attention import ContextParallelAttention
    from megatron_rl_patches.testing.cp_layout import gather_rows, split_rows

    attention = ContextParallelAttention(config, 1, AttnMaskType.causal, "self", layout=attention_layout)
    local = [split_rows(t, 0, split_layout, rank, CP, cu) for t in full]
    if cu is not None:  # megatron hands packed rows to the core attention as [t, np, hn]
        local = [t.squeeze(1) for t in local]
    local = [t.clone().requires_grad_() for t in local]
    params = None if cu is None else PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    out = attention(*local, None, packed_seq_params=params)
    out.backward(split_rows(grad_out, 0, split_layout, rank, CP, cu))
    back = [gather_rows(x, 0, attention_layout, cu_seqlens=cu) for x in [out, *(t.grad for t in local)]]
    return back if cu is None else [back[0]] + [g.unsqueeze(1) for g in back[1:]]


def _gpt_batch(form: str):
    from megatron_rl_patches.testing.megatron_cpu import make_batch
    from megatron_rl_patches.testing.packed_gpt import make_packed_batch

    if form == "thd":
        return make_packed_batch(PACKED, seed=5)
    return make_batch(batch_size=2, seq_length=16, seed=5)


def _forward(model, batch, **kwargs):
    return model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                 packed_seq_params=batch.get("packed_seq_params"), **kwargs)




def _gpt_case(case: str):
    """(layout, batch, cu_seqlens or None, per-token weights, position embedding type) of a case."""
    import torch

    layout, form, *rope = case.split("-")
    batch = _gpt_batch(form)
    cu = batch["packed_seq_params"].cu_seqlens_q if form == "thd" else None
    weights = torch.randn(batch["tokens"].shape, generator=torch.Generator().manual_seed(7))
    return layout, batch, cu, weights, "rope" if rope else "learned_absolute"


def _gpt_references(env) -> dict:
    """The CP=1 model (megatron's local attention; packed: the kit's block-diagonal mask around it)
    in a CP=1 world (megatron's RoPE splits its positions by the parallel state's CP size): the
    per-token losses, their gradients, the logits path's log-probs and entropy, their gradients."""
    from megatron_rl_patches import log_probs_and_entropy
    from megatron_rl_patches.testing.packed_gpt import packed_gpt_spec

    refs = {}
    for case in GPT_CASES:
        _, batch, cu, weights, positions = _gpt_case(case)
        reference = env.gpt(env.config(), layer_spec=packed_gpt_spec() if cu is not None else None, seed=3,
                            position_embedding_type=positions)
        loss = _forward(reference, batch, labels=batch["labels"])
        (weights * loss).sum().backward()
        loss_grads = collect_grads(reference)
        logits = _forward(reference, batch)
        lp, ent = log_probs_and_entropy(logits.reshape(-1, logits.size(-1)), batch["labels"].reshape(-1),
                                        with_entropy=True)
        (weights.reshape(-1) * (lp + 0.5 * ent)).sum().backward()
        refs[case] = (loss.detach(), loss_grads, lp.detach().view_as(loss), ent.detach().view_as(loss),
                      collect_grads(reference))
    return refs


def _gpt_checks(env, rank: int, refs: dict) -> dict:
    """A CP=2 GPTModel (the kit's attention) against the CP=1 model: per-token losses, every
    parameter's gradient (summed over the CP ranks), and the fused log-prob processor's log-probs
    and entropy with their gradients."""
    import torch

    from megatron_rl_patches import log_prob_output_processor
    from megatron_rl_patches.testing.cp_attention import cp_layer_spec
    from megatron_rl_patches.testing.cp_layout import gather_rows, split_batch, split_rows

    processor = log_prob_output_processor(with_entropy=True)
    results = {}
    for case in GPT_CASES:
        layout, batch, cu, weights, positions = _gpt_case(case)
        loss, want_grads, lp, ent, want_scored = refs[case]
        model = env.gpt(env.config(context_parallel_size=CP), layer_spec=cp_layer_spec(layout), seed=3,
                        position_embedding_type=positions)
        local = split_batch(batch, layout, rank, CP, cu)
        local_weights = split_rows(weights, 1, layout, rank, CP, cu)
        got_loss = _forward(model, local, labels=local["labels"])
        (local_weights * got_loss).sum().backward()
        got_grads = collect_grads(model, summed_over=torch.distributed.group.WORLD)
        scored = _forward(model, local, labels=local["labels"], output_processor=processor)
        (local_weights * (scored["log_probs"] + 0.5 * scored["entropy"])).sum().backward()
        got_scored = collect_grads(model, summed_over=torch.distributed.group.WORLD)

        def back(x, layout=layout, cu=cu):
            return gather_rows(x.detach(), 1, layout, cu_seqlens=cu)

        results[case] = {
            "loss": relative_error(back(got_loss), loss),
            "grads": max(relative_error(got_grads[n], want_grads[n]) for n in want_grads),
            "log_probs": relative_error(back(scored["log_probs"]), lp),
            "entropy": relative_error(back(scored["entropy"]), ent),
            "scored_grads": max(relative_error(got_scored[n], want_scored[n]) for n in want_scored),
            "same_names": sorted(got_grads) == sorted(want_grads),
        }
        results[case].update(_topk_checks(model, local, local_weights))
        teacher = env.gpt(env.config(context_parallel_size=CP), layer_spec=cp_layer_spec(layout), seed=4,
                          position_embedding_type=positions).requires_grad_(False)
        results[case].update(_divergence_checks(model, teacher, local, local_weights))
        results[case]["builds"] = _cp_build_checks(env, layout, positions, local)
        other = "contiguous" if layout == "zigzag" else "zigzag"
        wrong = split_batch(batch, other, rank, CP, cu)
        with torch.no_grad():  # rows split zigzag read back as contiguous, or the other way round
            results[case + " wrong order"] = relative_error(back(_forward(model, wrong, labels=wrong["labels"])), loss)
    return results


def _topk_checks(model, local: dict, local_weights) -> dict:
    """The top-k processor on this CP rank's rows against the CP model's own logits path: the ids
    (a bool), the log-probs and tail, every gradient summed over the CP ranks; "topk_hot" (the
    processor at temperature 0.8) is the negative control and is popped by the test."""
    import torch

    from megatron_rl_patches import topk_ids, topk_logprobs, topk_output_processor

    def run(temperature=None):
        if temperature is None:
            rows = _forward(model, local)
            rows = rows.reshape(-1, rows.size(-1))
            ids = topk_ids(rows.detach(), TOPK)
            lp, tail = topk_logprobs(rows, ids)
            values = torch.cat([lp, tail[:, None]], dim=-1).view(*local["tokens"].shape, TOPK + 1)
            ids = ids.view(*local["tokens"].shape, TOPK)
        else:
            out = _forward(model, local, output_processor=topk_output_processor(k=TOPK, temperature=temperature))
            ids, values = out["topk_ids"], torch.cat([out["topk_log_probs"], out["tail"][..., None]], dim=-1)
        (local_weights[..., None] * values).sum().backward()
        return ids, values.detach(), collect_grads(model, summed_over=torch.distributed.group.WORLD)

    want_ids, want, want_grads = run()
    ids, got, grads = run(1.0)
    _, _, hot_grads = run(0.8)
    return {"topk_ids": 0.0 if torch.equal(ids, want_ids) else 1.0, "topk_values": relative_error(got, want),
            "topk_grads": grad_error(grads, want_grads), "topk_hot": grad_error(hot_grads, want_grads)}


def _divergence_checks(model, teacher, local: dict, local_weights) -> dict:
    """The divergence processor (jsd from a CP teacher's hidden states on the same rows) against the
    dense float64 divergence of the two models' logits: values, every student gradient summed over
    the CP ranks; "divergence_beta" (another beta) is the negative control, popped by the test."""
    import torch

    from megatron_rl_patches import divergence_output_processor, hidden_output_processor
    from megatron_rl_patches.testing.divergence_reference import dense_divergence

    with torch.no_grad():
        hidden = _forward(teacher, local, output_processor=hidden_output_processor())
        teacher_rows = _forward(teacher, local)
        teacher_rows = teacher_rows.reshape(-1, teacher_rows.size(-1)).double()
    context = {"teacher_hidden": hidden, "teacher_weight": teacher.output_layer.weight}

    def run(fused: bool, beta: float = 0.4):
        if fused:
            values = _forward(model, local, output_processor=divergence_output_processor(divergence="jsd", beta=beta),
                              output_processor_context=context)
        else:
            rows = _forward(model, local)
            values = dense_divergence(rows.reshape(-1, rows.size(-1)).double(), [teacher_rows], divergence="jsd",
                                      beta=beta).view(local["tokens"].shape)
        (local_weights * values).sum().backward()
        return values.detach().double(), collect_grads(model, summed_over=torch.distributed.group.WORLD)

    want, want_grads = run(False)
    got, grads = run(True)
    _, beta_grads = run(False, beta=0.6)
    return {"divergence": relative_error(got, want, floor=1e-30),
            "divergence_grads": grad_error(grads, want_grads, floor=1e-30),
            "divergence_beta": grad_error(beta_grads, want_grads, floor=1e-30)}



def _cp_build_checks(env, layout: str, positions: str, local: dict) -> float:
    """The inference builds at CP=2 (rows as each rank holds them): the logits of the resident,
    swap and stream builds and of score_layer_major on a stream build against the trainable
    model's in eval (bitwise: 0.0)."""
    import torch

    from megatron_rl_patches.inference import build_inference_model, score_layer_major
    from megatron_rl_patches.testing.cp_attention import cp_layer_spec

    def provider(pre_process=True, post_process=True, vp_stage=None):
        return env.gpt(env.config(context_parallel_size=CP), layer_spec=cp_layer_spec(layout), seed=3,
                       position_embedding_type=positions)

    with torch.no_grad():
        want = _forward(provider().eval(), local)
        outs = [_forward(chunks[0], local) for _, chunks in each_residency(provider)]
    keywords = {"input_ids": local["tokens"], "position_ids": local["position_ids"],
                "attention_mask": local["attention_mask"], "packed_seq_params": local.get("packed_seq_params")}
    outs += score_layer_major(build_inference_model(provider, residency="stream"), [keywords])
    return max(float((out - want).abs().max()) for out in outs)


def _cp_world(rank: int, world_size: int) -> dict:
    import megatron_rl_patches
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    megatron_rl_patches.apply(only="gpt_output_processor")  # `native` on >= 0.18
    with megatron_on_cpu() as env:
        refs = _gpt_references(env)
    with megatron_on_cpu(context_parallel=world_size) as env:
        return {"attention": _attention_checks(env, rank), "gpt": _gpt_checks(env, rank, refs)}


@pytest.fixture(scope="module")
def cp_world() -> list[dict]:
    return run_multirank(_cp_world, CP, timeout=300)


def _marks(case: str) -> list:
    layout, form, *rope = case.split("-")
    return [layouts.mark("cp2-zigzag" if layout == "zigzag" else "cp2-allgather", form, *rope)]


PARAMS = [pytest.param(case, id=case, marks=_marks(case)) for case in CASES]
GPT_PARAMS = [pytest.param(case, id=case, marks=_marks(case)) for case in GPT_CASES]


@pytest.mark.parametrize("case", PARAMS)
def test_attention_equals_megatron_local_attention_at_cp1(cp_world, case):
    for result in cp_world:
        out, grad_q, grad_k, grad_v = result["attention"][case]
        assert max(out, grad_q, grad_k, grad_v) <= REL, (out, grad_q, grad_k, grad_v)
        assert result["attention"][case + " wrong order"] > 1e-2  # the check sees a wrong chunk order


@pytest.mark.parametrize("case", GPT_PARAMS)
def test_cp2_gpt_trains_and_scores_like_cp1(cp_world, case):
    for result in cp_world:
        figures = result["gpt"][case]
        assert figures.pop("same_names")
        assert figures.pop("builds") == 0.0  # resident = trainable in eval, swap = stream = resident
        assert figures.pop("topk_hot") > 1e-3  # the top-k comparison sees another temperature
        assert figures.pop("divergence_beta") > 1e-2  # the divergence comparison sees another beta
        divergence = (figures.pop("divergence"), figures.pop("divergence_grads"))
        assert max(divergence) <= REL_DIVERGENCE, divergence
        assert max(figures.values()) <= REL, figures
        assert result["gpt"][case + " wrong order"] > 1e-2
