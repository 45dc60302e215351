"""A real megatron-core GPTModel on CPU running a micro-batch under its shared-prefix plan against
the ordinary packed forward of the same micro-batch: log-probs and entropy within 1e-6 (float32,
relative to their scale), every parameter's gradient within 2e-6 in float32 (its sums over the
rows meet the G rows of a prefix in another order: float32's own noise, measured up to 1.1e-6 on a
final layer norm) and within 1e-12 in float64 (exact in exact arithmetic), the embedding handed P + C + G·R
tokens where the ordinary path hands G·(P + C + R); groups of 1, 2 and 8 with prompts below, at and
above a block of 128, with a privileged context before the prompt; plain RoPE, grouped-query heads,
Llama 3's RoPE scaling and learned absolute positions; the fused output processors; an MoE; ordinary
calls unchanged bit for bit; what the plan cannot run refused by name, never computed silently."""
from __future__ import annotations

import inspect

import pytest
import torch
from kit.shared_prefix import TokenCount, grpo_batch, objective, ordinary, planned, scores

from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error

pytestmark = pytest.mark.megatron
TOL = 1e-6
GRAD_TOL = {torch.float32: 2e-6, torch.float64: 1e-12}

CONFIGS = {
    "rope-gqa": dict(num_query_groups=2),
    "llama3-rope": dict(rope_scaling=True),
    "learned-absolute": dict(),
}
SHAPES = {  # name: (groups, alone, context)
    "g1-p100": (((100, (7,)),), (9,), 0),
    "g2-p128": (((128, (5, 11)),), (), 0),
    "g8-p133-two-prompts": (((133, (3, 7, 1, 9, 4, 2, 6, 5)), (20, (4, 4))), (6,), 0),
    "g4-context30-p40": (((40, (6, 2, 8, 3)),), (5,), 30),
}


def _model(config_name: str, dtype=torch.float32, **overrides):
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    values = dict(CONFIGS[config_name])
    rope_scaling = values.pop("rope_scaling", False)
    config = tiny_gpt_config(**values, **overrides, params_dtype=dtype, pipeline_dtype=dtype)
    embedding = "learned_absolute" if config_name == "learned-absolute" else "rope"
    model = build_packed_gpt(seq_length=512, seed=3, config=config, position_embedding_type=embedding)
    if rope_scaling:  # megatron-core's llama3 scaling on the model's own table (as a Llama 3.1 build has it)
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        model.rotary_pos_emb = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0,
                                               rope_scaling=True, rope_scaling_factor=8.0, rotary_base=500000)
    return model.to(dtype)


def _run(model, batch, route):
    logits = route(model, batch)
    log_probs, entropy = scores(logits, batch)
    objective(log_probs, entropy).backward()
    return log_probs.detach(), entropy.detach(), collect_grads(model)


CASES = [(config, torch.float32) for config in sorted(CONFIGS)] + [("rope-gqa", torch.float64)]


@layouts.mark("thd")
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize(("config_name", "dtype"), CASES, ids=[f"{c}-{str(d)[6:]}" for c, d in CASES])
def test_the_planned_forward_equals_the_packed_one(megatron_cpu, config_name, dtype, shape):
    groups, alone, context = SHAPES[shape]
    batch = grpo_batch(groups, alone, padding=5, context=context, seed=len(shape))
    model = _model(config_name, dtype)
    count = TokenCount(model)
    want = _run(model, batch, ordinary)
    got = _run(model, batch, planned)
    count.close()
    assert relative_error(got[0], want[0]) < TOL and relative_error(got[1], want[1]) < TOL
    assert grad_error(got[2], want[2]) < GRAD_TOL[dtype]
    plan = batch.plan()
    trie = {tuple(sample[:k + 1]) for sample in batch.sequences for k in range(len(sample))}
    assert plan.stats.physical_tokens == len(trie)  # every distinct leading-token sequence once
    assert count.seen == [batch.tokens.numel(), plan.physical_length]


def test_the_negative_control_a_plan_that_lets_siblings_see_each_other_differs(megatron_cpu):
    from megatron_rl_patches.shared_prefix import prepare_shared_prefix, shared_prefix_params

    batch = grpo_batch(((30, (6, 6)),), (), padding=0)
    model = prepare_shared_prefix(_model("rope-gqa"))
    want = scores(ordinary(model, batch), batch)[0]

    plan = batch.plan()
    first, second = plan.segment_starts[1:3].tolist()  # the first remainder's subtree reaches over the second's
    plan.reach = plan.reach.clone()
    plan.reach[first:second] = second + 6
    got = scores(model(batch.tokens, None, None, packed_seq_params=shared_prefix_params(plan)), batch)[0]
    assert relative_error(got[:36], want[:36]) < TOL and relative_error(got, want) > 1e-4


def test_the_fused_processors_on_the_logical_rows(megatron_cpu, clean_patch_state):
    import megatron_rl_patches
    from megatron_rl_patches import log_prob_output_processor, topk_output_processor

    megatron_rl_patches.apply(only="gpt_output_processor")  # the keyword on megatron-core < 0.18
    batch = grpo_batch(((50, (4, 8, 2)),), (7,), padding=3)
    model = _model("rope-gqa")
    rows = torch.zeros_like(batch.labels, dtype=torch.bool)
    rows[0, batch.rows] = True
    for processor, keys in ((log_prob_output_processor(with_entropy=True), ("log_probs", "entropy")),
                            (topk_output_processor(k=4), ("topk_log_probs", "tail"))):
        results = []
        for route in (ordinary, planned):
            out = route(model, batch, labels=batch.labels, output_processor=processor,
                        output_processor_context={"row_mask": rows})
            values = [out[key][0, batch.rows] for key in keys]
            sum(v.sum() * (i + 1) for i, v in enumerate(values)).backward()
            results.append((values, collect_grads(model)))
        (want, want_grads), (got, got_grads) = results
        assert all(relative_error(g.detach(), w.detach()) < TOL for g, w in zip(got, want))
        assert grad_error(got_grads, want_grads) < GRAD_TOL[torch.float32]


def test_ordinary_calls_are_unchanged_bit_for_bit_after_prepare(megatron_cpu):
    from megatron_rl_patches.shared_prefix import prepare_shared_prefix

    batch = grpo_batch()
    model = _model("rope-gqa")
    before = ordinary(model, batch).detach()
    prepare_shared_prefix(prepare_shared_prefix(model))  # twice: installed once
    planned(model, batch)
    assert torch.equal(ordinary(model, batch).detach(), before)
    hooks = model._forward_pre_hooks
    assert len(hooks) == 1
    assert [len(layer.self_attention._forward_pre_hooks) for layer in model.decoder.layers] == [1, 1]


def test_an_moe_model_routes_each_token_as_its_own_sample_does(megatron_cpu, moe_router_on_cpu):
    from megatron_rl_patches.shared_prefix import check_shared_prefix

    batch = grpo_batch(((60, (5, 3, 9)),), (4,), padding=2)
    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather",
               moe_ffn_hidden_size=64, add_bias_linear=False)  # the kit's MoE (tiny_moe_config)
    model = _model("rope-gqa", **moe)
    check_shared_prefix(model, training=True)
    want, got = _run(model, batch, ordinary), _run(model, batch, planned)
    assert relative_error(got[0], want[0]) < TOL and grad_error(got[2], want[2]) < GRAD_TOL[torch.float32]
    recomputed = _model("rope-gqa", **{**moe, "moe_aux_loss_coeff": 0.01, "recompute_granularity": "selective",
                                       "recompute_modules": ["moe"]})
    with pytest.raises(ValueError, match=r"MoE load balancing in training with the MoE layer recomputed alone "
                                         r"\(moe_aux_loss_coeff=0.01"):
        check_shared_prefix(recomputed, training=True)  # its router would run outside the layer's call
    balanced = _model("rope-gqa", **{**moe, "moe_aux_loss_coeff": 0.01})
    check_shared_prefix(balanced, training=True)  # the router's statistics on each sample's rows (moe_statistics)
    check_shared_prefix(balanced, training=False)  # forward-only passes: the statistics are not used
    with torch.no_grad():
        assert relative_error(scores(planned(balanced, batch), batch)[0],
                              scores(ordinary(balanced, batch), batch)[0]) < TOL


REFUSALS = {
    "cp2-window": (dict(context_parallel_size=2, window_size=(4, 0)), False, "a sliding window or an attention sink"),
    "moe-sinkhorn-cp": (dict(num_moe_experts=4, moe_router_load_balancing_type="sinkhorn", context_parallel_size=2),
                        True, "Sinkhorn's under sequence parallelism or context parallelism"),
    "mla-interleaved": (dict(multi_latent_attention=True, rotary_interleaved=True), False, "multi-latent attention"),
    "mtp-depth-3": (dict(mtp_num_layers=3), False, "multi-token prediction"),
    "pp2-fixed-lengths": (dict(pipeline_model_parallel_size=2), False, "variable_seq_lengths"),
    "moe-token-dropping": (dict(num_moe_experts=4, moe_expert_capacity_factor=1.0), False, "token dropping"),
    "moe-quantile": (dict(num_moe_experts=4, moe_router_load_balancing_type="quantile"), True, "quantile"),
    "moe-sinkhorn-sp": (dict(num_moe_experts=4, moe_router_load_balancing_type="sinkhorn", sequence_parallel=True,
                             tensor_model_parallel_size=2), True, "Sinkhorn's under sequence parallelism"),
}


@pytest.mark.parametrize(("overrides", "training", "message"), list(REFUSALS.values()), ids=list(REFUSALS))
def test_what_the_plan_cannot_run_is_refused_by_name(overrides, training, message):
    from types import SimpleNamespace

    from megatron_rl_patches.shared_prefix.refusals import config_reason

    config = SimpleNamespace(**{"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.0, **overrides})
    assert message in config_reason(config, training)
    plain = {k: v for k, v in vars(config).items() if k.startswith("moe_router_load") or k == "moe_aux_loss_coeff"}
    assert config_reason(SimpleNamespace(**plain), training) is None


class MambaMixer(torch.nn.Module):
    """A recurrent layer the plan does not serve (by its class's name, as megatron-core's)."""

    def forward(self, hidden_states, packed_seq_params=None):
        return hidden_states


def test_a_recurrent_layer_is_refused_by_name_on_every_rank(megatron_cpu):
    from megatron_rl_patches.inference.gated_delta_net import GatedDeltaNetLayer
    from megatron_rl_patches.shared_prefix import check_shared_prefix

    model = _model("rope-gqa")
    model.decoder.layers[0].extra = MambaMixer()
    with pytest.raises(ValueError, match="Mamba layers"):
        check_shared_prefix(model, training=False)
    # the package's gated delta net runs a plan at one context-parallel rank only
    model.decoder.layers[0].extra = GatedDeltaNetLayer.__new__(GatedDeltaNetLayer)
    torch.nn.Module.__init__(model.decoder.layers[0].extra)
    model.decoder.layers[0].extra.cp_size = 1
    check_shared_prefix(model, training=False)
    model.decoder.layers[0].extra.cp_size = 2
    with pytest.raises(ValueError, match="the package's gated delta net .* at context parallelism"):
        check_shared_prefix(model, training=False)


def test_bad_input_is_refused_by_name_and_an_unprepared_model_never_computes_silently(megatron_cpu):
    from megatron_rl_patches.shared_prefix import prepare_shared_prefix, shared_prefix_params

    batch = grpo_batch()
    model = _model("rope-gqa")
    params = shared_prefix_params(batch.plan())
    # a core attention refuses packed params it was not built for (megatron-core's local one asserts, Transformer
    # Engine's names the format, the kit's stand-in finds the rows do not add up): never a silent causal pass
    with pytest.raises((ValueError, AssertionError, RuntimeError)):
        model(batch.tokens, None, None, packed_seq_params=params)
    prepare_shared_prefix(model)
    other = batch.tokens.clone()
    other[0, 3] = (other[0, 3] + 1) % 64
    with pytest.raises(ValueError, match="differ from the ids the plan was built from"):
        model(other, None, None, packed_seq_params=params)
    with pytest.raises(ValueError, match=r"must be the packed ids the plan was built from, \[1, "):
        model(batch.tokens[:, :-1], None, None, packed_seq_params=params)
    far = grpo_batch(vocab=80)
    with pytest.raises(ValueError, match="past the model's vocabulary"):
        model(far.tokens, None, None, packed_seq_params=shared_prefix_params(far.plan()))
    from megatron_rl_patches.shared_prefix import plan_shared_prefix

    # plan_shared_prefix refuses -1 itself; a plan made by other hands meets the hook
    negative = plan_shared_prefix(batch.tokens.clone(), batch.cu_seqlens, samples=batch.samples)
    negative.tokens[negative.logical_rows[3]] = -1
    negative.logical_tokens[3] = -1
    with pytest.raises(ValueError, match="token id -1 is negative: the model's ids are 0 to 63"):
        model(negative.logical_tokens[None].clone(), None, None, packed_seq_params=shared_prefix_params(negative))
    with pytest.raises(TypeError, match=r"^shared_prefix_params: plan must be a SharedPrefixPlan, got Tensor$"):
        shared_prefix_params(batch.tokens)
    with pytest.raises(ValueError, match="no megatron-core language model"):
        prepare_shared_prefix([torch.nn.Linear(2, 2)])
    with pytest.raises(TypeError, match=r"^prepare_shared_prefix: expected megatron-core model chunks, got str$"):
        prepare_shared_prefix(["a model"])
    assert torch.equal(batch.tokens, grpo_batch().tokens)  # the caller's tensors untouched


@layouts.mark("recompute")
def test_full_activation_recompute_reruns_the_plan_in_backward(megatron_cpu):
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    batch = grpo_batch(((45, (5, 8, 2)),), (6,), padding=3)
    model = _model("rope-gqa", **recompute)
    want, got = _run(model, batch, ordinary), _run(model, batch, planned)
    assert relative_error(got[0], want[0]) < TOL and grad_error(got[2], want[2]) < GRAD_TOL[torch.float32]


@layouts.mark("bf16")
def test_bf16_under_float16module_to_bf16_rounding(megatron_cpu):
    from megatron.core.transformer.module import Float16Module

    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    config = tiny_gpt_config(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
                             num_query_groups=2)
    model = Float16Module(config, build_packed_gpt(seq_length=512, seed=3, config=config))
    batch = grpo_batch(((45, (5, 8, 2)),), (6,), padding=3)
    want, got = _run(model, batch, ordinary), _run(model, batch, planned)
    error = relative_error(got[0], want[0])
    assert error < 2e-2 and grad_error(got[2], want[2]) < 5e-2  # bf16: 8 bits of mantissa
    # the negative control at bf16's scale: other samples' log-probs miss by far more
    other = grpo_batch(((45, (5, 8, 2)),), (6,), padding=3, seed=99)
    assert relative_error(_run(model, other, planned)[0], want[0]) > 4 * error


@layouts.mark("hybrid")
def test_a_hybrid_model_equals_each_samples_own_forward(megatron_cpu):
    from megatron_rl_patches import log_probs_and_entropy
    from megatron_rl_patches.shared_prefix import prepare_shared_prefix, shared_prefix_params
    from megatron_rl_patches.testing.megatron_cpu import ModelKindUnavailable, build_tiny_hybrid, tiny_gpt_config

    try:
        model = build_tiny_hybrid(tiny_gpt_config(num_layers=4, num_query_groups=2), seq_length=256, seed=2)
    except ModelKindUnavailable as exc:
        pytest.skip(str(exc))
    batch = grpo_batch(((40, (6, 3, 9)),), (7,), padding=2)
    prepare_shared_prefix(model)
    logits = model(batch.tokens, None, None, packed_seq_params=shared_prefix_params(batch.plan()))
    starts = batch.cu_seqlens.tolist()
    for i, sequence in enumerate(batch.sequences):
        tokens = torch.tensor(sequence)[None]
        causal = ~torch.ones(len(sequence), len(sequence), dtype=torch.bool).tril()
        own = model(tokens, torch.arange(len(sequence))[None], causal[None, None])
        rows = slice(starts[i], starts[i] + len(sequence) - 1)
        want = log_probs_and_entropy(own[0, :-1], tokens[0, 1:])[0]
        got = log_probs_and_entropy(logits[0, rows], tokens[0, 1:])[0]
        assert relative_error(got, want) < TOL, f"sample {i}"


def test_the_params_span_the_stream_as_one_int32_sequence_in_both_directions(megatron_cpu):
    from megatron_rl_patches.shared_prefix import shared_prefix_params

    plan = grpo_batch().plan(pad_to=4)
    params = shared_prefix_params(plan, route="mask")
    whole = torch.tensor([0, plan.physical_length], dtype=torch.int32)
    for cu in (params.cu_seqlens_q, params.cu_seqlens_kv):
        assert cu.dtype == torch.int32 and torch.equal(cu, whole)
    assert (params.qkv_format, params.route, params.shared_prefix) == ("shared_prefix", "mask", plan)
    assert params.max_seqlen_q == params.max_seqlen_kv == plan.longest


def test_a_chunk_added_after_prepare_is_prepared_and_the_decoders_output_is_checked(megatron_cpu):
    """prepare_shared_prefix over [a prepared chunk, a new one] installs the new one's seams too; the
    decoder's hook names what it got where its output is no tensor."""
    from megatron_rl_patches.shared_prefix import prepare_shared_prefix, shared_prefix_params
    from megatron_rl_patches.shared_prefix.kinds.language_models import logical_rows

    first, second = _model("rope-gqa"), _model("rope-gqa")
    prepare_shared_prefix(first)
    prepare_shared_prefix([first, second])
    assert len(second._forward_pre_hooks) == 1 and len(second.decoder._forward_hooks) == 1
    params = shared_prefix_params(grpo_batch().plan())
    with pytest.raises(ValueError, match=r"^shared prefix: the decoder returned tuple, not its hidden states$"):
        logical_rows(second.decoder, (), {"packed_seq_params": params}, (torch.zeros(1),))


def test_a_decoder_input_given_is_taken_as_the_plans_physical_rows(megatron_cpu):
    from megatron_rl_patches.shared_prefix import prepare_shared_prefix, shared_prefix_params

    batch = grpo_batch()
    model = prepare_shared_prefix(_model("rope-gqa"))
    plan = batch.plan()
    params = shared_prefix_params(plan)
    with torch.no_grad():
        want = model(batch.tokens, None, None, packed_seq_params=params)
        rows = model.embedding(input_ids=plan.tokens[None], position_ids=plan.positions[None])
        assert torch.equal(model(None, None, None, decoder_input=rows, packed_seq_params=params), want)


def test_the_language_models_refusals_are_said_whole(megatron_cpu):
    from megatron_rl_patches.shared_prefix import prepare_shared_prefix, shared_prefix_params

    batch = grpo_batch()
    model = prepare_shared_prefix(_model("rope-gqa"))
    params = shared_prefix_params(batch.plan())
    with pytest.raises(ValueError, match=rf"^shared prefix: input_ids must be the packed ids the plan was built from, "
                                         rf"\[1, {batch.tokens.size(1)}\], got list$"):
        model(batch.tokens[0].tolist(), None, None, packed_seq_params=params)
    from megatron_rl_patches.shared_prefix.kinds.attention_layers import rotary_at_positions

    short = {"attention_mask": None, "rotary_pos_emb": torch.zeros(3, 1, 1, 8), "packed_seq_params": params}
    with pytest.raises(ValueError, match=rf"^shared prefix: the model's rotary table has 3 rows, the plan's longest "
                                         rf"sample {batch.plan().longest}$"):
        rotary_at_positions(model.decoder.layers[0].self_attention, (torch.zeros(1),), short)
    other = batch.tokens.clone()
    other[0, 3] = (other[0, 3] + 1) % 64
    with pytest.raises(ValueError, match=r"^shared prefix: input_ids differ from the ids the plan was built from "
                                         r"\(build the plan from this micro-batch's tokens\)$"):
        model(other, None, None, packed_seq_params=params)
    if "padding_mask" not in inspect.signature(type(model).forward).parameters:
        return  # megatron-core before padding_mask
    with pytest.raises(ValueError, match=r"^shared prefix: padding_mask is not taken with a shared-prefix plan \(the "
                                         r"plan's padding rows are its own\); pass padding_mask=None$"):
        model(batch.tokens, None, None, packed_seq_params=params,
              padding_mask=torch.zeros_like(batch.tokens, dtype=torch.bool))
