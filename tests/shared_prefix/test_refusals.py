"""What a shared-prefix plan runs: only what it knows exact (`refusals.py`, the table of
`known_config.FIELDS`). Every field of the installed megatron-core's TransformerConfig is in the
table; each checked field flipped from its default on a real tiny config is refused by name (field =
value) or, where the table allows the value, runs exact against the same samples packed whole; a
field the table does not know runs only at its default; a model with sliding windows or attention
sinks, a module that reads packed_seq_params itself (slime's HuggingfaceAttention's kind) or a core
attention the package does not know are refused by name; MoE expert bias at update rate 0 runs
exact in training; each door's refusal names its own remedy."""
from __future__ import annotations

import dataclasses
import logging
import re

import pytest
import torch
from kit.shared_prefix import grpo_batch, objective, ordinary, planned, scores

from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error

pytestmark = pytest.mark.megatron
TOL, GRAD_TOL = 1e-6, 2e-6
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="allgather", moe_ffn_hidden_size=64,
           moe_aux_loss_coeff=0.0, add_bias_linear=False)
DSA = dict(experimental_attention_variant="dsa", add_bias_linear=False)
RECOMPUTED_MOE = {**MOE, "recompute_granularity": "selective", "recompute_modules": ["moe"]}

# field: (a value other than the default, the config it is set on, training) -> refused by name
REFUSED = {
    "context_parallel_size": (2, {"window_size": (8, 0)}, False),
    "hybrid_context_parallel": (True, {}, False),
    "pipeline_model_parallel_size": (2, {}, False),
    "virtual_pipeline_model_parallel_size": (2, {}, False),
    "multi_latent_attention": (True, {"rotary_interleaved": True}, False),
    "mtp_num_layers": (3, {}, False),
    "softmax_type": ("quadratic", {}, False),
    "window_size": ((8, 4), {}, False),
    "experimental_attention_variant": ("linear_attention", {}, False),  # a variant the plan does not know
    "dsa_indexer_loss_coeff": (0.1, DSA, True),
    "dsa_kernel_backend": ("tilelang", DSA, False),
    "dsa_indexer_topk_freq": (2, DSA, False),
    "dsa_indexer_rope_interleaved": (True, DSA, False),
    "fused_single_qkv_rope": (True, {}, False),
    "qk_clip": (True, {}, False),
    "log_max_attention_logit": (True, {}, False),
    "heterogeneous_block_specs": (True, {}, False),
    "enable_cuda_graph": (True, {}, False),
    "external_cuda_graph": (True, {}, False),
    "cuda_graph_impl": ("local", {}, False),
    "hidden_dropout": (0.1, {}, True),
    "attention_dropout": (0.1, {}, True),
    "position_embedding_type": ("mrope", {}, False),
    "moe_expert_capacity_factor": (1.0, MOE, False),
    "moe_token_dropping": (True, MOE, False),
    "moe_router_load_balancing_type": ("quantile", MOE, True),
    "moe_aux_loss_coeff": (0.01, RECOMPUTED_MOE, True),
    "moe_z_loss_coeff": (1e-3, RECOMPUTED_MOE, True),
    "moe_router_enable_expert_bias": (True, {**RECOMPUTED_MOE, "moe_router_bias_update_rate": 1e-3}, True),
    "moe_router_force_load_balancing": (True, MOE, False),
    "moe_input_jitter_eps": (0.01, MOE, True),
    "moe_enable_routing_replay": (True, {**MOE, "context_parallel_size": 2}, False),
    "moe_router_padding_for_quantization": (True, MOE, False),
    "moe_router_padding_for_fp8": (True, MOE, False),
    "moe_router_force_biased": (0.5, MOE, False),
    "moe_expert_rank_capacity_factor": (1.0, MOE, False),
    "use_mup": (True, {}, False),
}
# checked fields whose other values the table allows: (value, config, training), each run planned below
ALLOWED = {
    "pipeline_model_parallel_size": (2, {"variable_seq_lengths": True, "moe_token_dispatcher_type": "alltoall"},
                                     True),  # planned in test_layouts.py
    # test_layouts.py (CP = 2), test_context_parallel_layouts.py (x TP = 2 + SP; beside MoE, MLA, PP = 2, MTP)
    "context_parallel_size": (2, {**MOE, "multi_latent_attention": True, "pipeline_model_parallel_size": 2,
                                  "variable_seq_lengths": True, "moe_token_dispatcher_type": "alltoall",
                                  "mtp_num_layers": 1}, True),
    "softmax_type": ("learnable", {}, True),  # test_windows_sinks.py
    "window_size": ((8, 0), {}, True),
    "mtp_num_layers": (0, {}, True),
    "experimental_attention_variant": ("gated_delta_net", {}, True),  # test_planned_gated_delta_net.py
    "dsa_indexer_loss_coeff": (0.1, DSA, False),  # forward-only passes; "dsa" itself: test_sparse_attention.py
    "multi_latent_attention": (True, {"pipeline_model_parallel_size": 2, "variable_seq_lengths": True,
                                      "moe_token_dispatcher_type": "alltoall"}, True),  # test_layouts.py at PP = 2
    "hidden_dropout": (0.1, {}, False),
    "attention_dropout": (0.1, {}, False),
    "position_embedding_type": ("none", {}, True),
    "moe_aux_loss_coeff": (0.01, MOE, False),  # forward-only passes: planned in test_model_hooks.py
    "moe_router_load_balancing_type": ("seq_aux_loss", MOE, True),  # its coefficient 0
    "moe_router_enable_expert_bias": (True, {**MOE, "moe_router_bias_update_rate": 0.0}, True),
    "moe_enable_routing_replay": (True, {**MOE, "tensor_model_parallel_size": 2, "sequence_parallel": True},
                                  True),  # test_routing_replay.py: 1 rank, TP = 2 + SP
}
# the router's statistics on each sample's own rows (tests/shared_prefix/test_moe_statistics.py, test_mtp.py)
ALLOWED_TOO = {
    "mtp_num_layers": (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True, "variable_seq_lengths": True,
                           "pipeline_model_parallel_size": 2, "moe_token_dispatcher_type": "alltoall"},
                       True),  # and test_layouts.py: TP = 2, TP = 2 + SP, PP = 2
    "experimental_attention_variant": ("dsa", DSA, True),  # test_sparse_attention.py
    "moe_router_load_balancing_type": ("sinkhorn", MOE, True),
    "moe_aux_loss_coeff": (0.01, MOE, True),
    "moe_z_loss_coeff": (1e-3, {**MOE, "tensor_model_parallel_size": 2, "sequence_parallel": True}, True),
    "moe_router_enable_expert_bias": (True, {**MOE, "moe_router_bias_update_rate": 1e-3, "sequence_parallel": True,
                                             "tensor_model_parallel_size": 2}, True),  # and test_layouts.py: TP 2 + SP
}


def _config(field: str, value, overrides: dict):
    """A real tiny TransformerConfig with `field` set to `value` after its checks (some values
    need Transformer Engine or CUDA to construct; the refusal reads the field, not the hardware)."""
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config

    config = tiny_gpt_config(**overrides)
    if field != "position_embedding_type":
        setattr(config, field, value)
    return config


def _reasons(field: str, value, overrides: dict, training: bool) -> list[str]:
    from megatron_rl_patches.shared_prefix.refusals import config_reasons

    embedding = value if field == "position_embedding_type" else "rope"
    return config_reasons(_config(field, value, overrides), training, embedding)


def test_every_field_of_the_installed_config_is_in_the_table():
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_rl_patches.shared_prefix.known_config import FIELDS

    missing = [f.name for f in dataclasses.fields(MLATransformerConfig) if f.name not in FIELDS]
    assert not missing, f"TransformerConfig fields the shared-prefix table does not classify: {missing}"
    checked = {name for name, known in FIELDS.items() if known.what}
    assert checked == set(REFUSED), "every checked field has a value flipped from its default here"


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_a_checked_field_flipped_from_its_default_is_refused_by_name(field):
    from megatron_rl_patches.shared_prefix.known_config import FIELDS

    value, overrides, training = REFUSED[field]
    assert _reasons(field, _default(field), overrides, training) == [], "the default runs"
    reasons = _reasons(field, value, overrides, training)
    assert len(reasons) == 1 and f"({field}={value!r}): " in reasons[0], reasons
    assert reasons[0].startswith(FIELDS[field].what)


def _default(field: str):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    fields = {f.name: f.default for f in dataclasses.fields(MLATransformerConfig)}
    if field != "position_embedding_type" and field not in fields:
        pytest.skip(f"{field} is not a field of this megatron-core's TransformerConfig")
    if field == "position_embedding_type":
        return "rope"
    if field in ("hidden_dropout", "attention_dropout"):
        return 0.0  # TransformerConfig's 0.1 is refused in training: RL runs without dropout
    if field == "multi_latent_attention":
        return False
    return fields[field]


@pytest.mark.parametrize("field, value, overrides, training", [(f, *ALLOWED[f]) for f in sorted(ALLOWED)]
                         + [(f, *ALLOWED_TOO[f]) for f in sorted(ALLOWED_TOO)])
def test_a_value_the_table_allows_is_not_refused(field, value, overrides, training):
    _default(field)  # skips a field this megatron-core lacks
    assert _reasons(field, value, overrides, training) == []


def test_a_field_the_table_does_not_know_runs_only_at_its_default():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rl_patches.shared_prefix.refusals import config_reasons

    @dataclasses.dataclass
    class NewerConfig(TransformerConfig):  # a field a newer megatron-core might add
        attention_trick: int = 0

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0)
    assert config_reasons(NewerConfig(**base), True) == []
    reasons = config_reasons(NewerConfig(**base, attention_trick=3), True)
    assert reasons == ["a setting the shared-prefix plan does not know (attention_trick=3, default 0): it may change "
                       "what a token sees; leave it at its default or do not share this model's prefixes"]

    @dataclasses.dataclass
    class FactoryConfig(TransformerConfig):  # a default made by a factory: read as that default
        attention_tricks: list = dataclasses.field(default_factory=list)

    assert config_reasons(FactoryConfig(**base), True) == []
    assert config_reasons(FactoryConfig(**base, attention_tricks=[1]), True) == [
        "a setting the shared-prefix plan does not know (attention_tricks=[1], default []): it may change what a "
        "token sees; leave it at its default or do not share this model's prefixes"]


def _exact(model, batch, training: bool = True) -> tuple[float, float]:
    """(log-prob error, gradient error) of the plan against the same samples packed whole."""
    results = []
    for route in (ordinary, planned):
        log_probs, entropy = scores(route(model, batch), batch)
        if training:
            objective(log_probs, entropy).backward()
        results.append((log_probs.detach(), collect_grads(model) if training else {}))
    (want, want_grads), (got, grads) = results
    return relative_error(got, want), grad_error(grads, want_grads) if training else 0.0


# per-token fields that change attention's inputs, each flipped from its default: accepted and exact
PER_TOKEN_FLIPS = {
    "rotary_interleaved": dict(rotary_interleaved=True),
    "qk_layernorm": dict(qk_layernorm=True),
    "softmax_scale": dict(softmax_scale=0.2),
    "no_rope_freq": dict(no_rope_freq=[0, 1]),
    "window_attn_skip_freq": dict(window_attn_skip_freq=2),
    "normalization+swiglu+qkv-bias": dict(normalization="RMSNorm", gated_linear_unit=True, add_qkv_bias=True),
    "selective-recompute": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
}


@pytest.mark.parametrize("flip", sorted(PER_TOKEN_FLIPS))
def test_a_per_token_field_flipped_runs_exact(megatron_cpu, flip):
    from megatron_rl_patches.shared_prefix import check_shared_prefix
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    try:
        config = tiny_gpt_config(num_query_groups=2, **PER_TOKEN_FLIPS[flip])
    except (TypeError, ValueError, AssertionError) as exc:  # a field this megatron-core lacks or refuses
        pytest.skip(f"{flip}: {exc}")
    model = build_packed_gpt(seq_length=256, seed=3, config=config)
    check_shared_prefix(model, training=True)
    log_probs, grads = _exact(model, grpo_batch(((45, (5, 8, 2)),), (6,), padding=3))
    assert log_probs < TOL and grads < GRAD_TOL


def test_no_position_embedding_runs_exact(megatron_cpu):
    from megatron_rl_patches.shared_prefix import check_shared_prefix
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    model = build_packed_gpt(seq_length=256, seed=3, config=tiny_gpt_config(), position_embedding_type="none")
    check_shared_prefix(model, training=True)
    log_probs, grads = _exact(model, grpo_batch(((45, (5, 8, 2)),), (6,), padding=3))
    assert log_probs < TOL and grads < GRAD_TOL


def test_moe_expert_bias_at_update_rate_0_runs_exact_in_training(megatron_cpu, moe_router_on_cpu):
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    from megatron_rl_patches.shared_prefix import check_shared_prefix
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    config = tiny_gpt_config(**MOE, moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0,
                             moe_router_score_function="sigmoid")
    model = build_packed_gpt(seq_length=256, seed=5, config=config)
    routers = [m for m in model.modules() if getattr(m, "expert_bias", None) is not None]
    assert routers
    with torch.no_grad():
        for router in routers:  # a bias that decides routes, as a trained one does
            router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.1, -0.4]))
    check_shared_prefix(model, training=True)
    batch = grpo_batch(((60, (5, 3, 9)),), (4,), padding=2)
    counts, biases, runs = [], [], []
    for route in (ordinary, planned):
        for router in routers:
            router.local_tokens_per_expert.zero_()
        log_probs, entropy = scores(route(model, batch), batch)
        objective(log_probs, entropy).backward()
        runs.append((log_probs.detach(), collect_grads(model)))
        counts.append(torch.stack([r.local_tokens_per_expert.clone() for r in routers]))
        stacked = torch.stack([r.expert_bias for r in routers])
        biases.append(get_updated_expert_bias(counts[-1], stacked, config.moe_router_bias_update_rate))
    (want, want_grads), (got, grads) = runs
    assert relative_error(got, want) < TOL and grad_error(grads, want_grads) < GRAD_TOL
    assert torch.equal(counts[0], counts[1])  # the router's statistics on each sample's rows (moe_statistics)
    assert torch.equal(biases[0], biases[1])  # and at rate 0 the updated bias is the same


def _refusal(model, training: bool = False) -> str:
    from megatron_rl_patches.shared_prefix import check_shared_prefix

    with pytest.raises(ValueError) as caught:
        check_shared_prefix(model, training=training)
    return str(caught.value)


def test_real_models_with_windows_or_sinks_are_accepted_and_a_window_looking_ahead_refused(megatron_cpu):
    from megatron_rl_patches.shared_prefix import shared_prefix_reason
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    cases = [dict(window_size=(8, 0), window_attn_skip_freq=2), dict(softmax_type="off-by-one"),
             dict(softmax_type="learnable")]  # each exact: tests/shared_prefix/test_windows_sinks.py
    built = 0
    for overrides in cases:
        try:
            model = build_packed_gpt(seq_length=256, config=tiny_gpt_config(**overrides))
        except (TypeError, AssertionError):  # megatron-core < 0.15: no sinks, windows in Transformer Engine only
            continue
        built += 1
        assert shared_prefix_reason(model, training=True) is None, overrides
        model.config.window_size = (8, 4)
        assert "a sliding window that sees later tokens (window_size=(8, 4))" in _refusal(model, training=True)
    from megatron.core.transformer.transformer_config import TransformerConfig

    assert built == 3 or "softmax_type" not in {f.name for f in dataclasses.fields(TransformerConfig)}


def test_a_module_reading_packed_seq_params_itself_is_refused_by_its_class(megatron_cpu):
    from megatron.core.transformer.attention import SelfAttention

    from megatron_rl_patches.shared_prefix import prepare_shared_prefix
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    class OwnAttention(SelfAttention):  # as slime's HuggingfaceAttention: it reads the sequences itself
        def forward(self, hidden_states, attention_mask, packed_seq_params=None, **kwargs):
            assert packed_seq_params.cu_seqlens_q is not None
            return super().forward(hidden_states, attention_mask, packed_seq_params=packed_seq_params, **kwargs)

    model = build_packed_gpt(seq_length=256)
    prepare_shared_prefix(model)
    from megatron_rl_patches.shared_prefix import check_shared_prefix

    check_shared_prefix(model, training=True)  # a prepared model is known: each pass's door checks again
    model.decoder.layers[1].self_attention.__class__ = OwnAttention
    message = _refusal(model)
    assert (f"a module the plan does not know ({OwnAttention.__module__}.{OwnAttention.__qualname__} at "
            "decoder.layers.1.self_attention takes packed_seq_params") in message


def test_a_core_attention_the_package_does_not_know_is_refused_by_its_class(megatron_cpu):
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt, packed_attention_class

    class SinkCore(packed_attention_class()):  # a core with arithmetic of its own (slime's flash core's kind)
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **kwargs):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params, **kwargs) * 0.5

    model = build_packed_gpt(seq_length=256)
    model.decoder.layers[0].self_attention.core_attention.__class__ = SinkCore
    assert "SinkCore at decoder.layers.0.self_attention.core_attention takes packed_seq_params" in _refusal(model)


def _with_core(core) -> object:
    """A real GPTModel whose every layer's core attention is built as `core` (its own __init__ run)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import packed_gpt_spec

    torch.manual_seed(3)
    spec = packed_gpt_spec()
    spec.submodules.self_attention.submodules.core_attention = core
    return GPTModel(config=tiny_gpt_config(), transformer_layer_spec=spec, vocab_size=64, max_sequence_length=256,
                    position_embedding_type="rope")


def _own_cores() -> dict:
    """Issue 119 item 1: two cores of their own the allow-list let through (9e804589) and the plan ran
    with the plain causal core's arithmetic in their place: one sets its own softmax scale in its
    __init__ (no forward of its own), one has a forward of its own taking the packed sequences through
    **kwargs (no parameter named packed_seq_params). Measured there on this test's batch against the same
    samples packed whole: log-probs 6.5e-5 and 7.5e-5 off, gradients 5.3e-3 and 6.1e-3."""
    from megatron_rl_patches.testing.packed_gpt import packed_attention_class

    class ScaledCore(packed_attention_class()):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.softmax_scale = 0.2  # megatron-core's core reads it; the config's scale is 1/sqrt(8)

    class TemperedCore(packed_attention_class()):
        def forward(self, query, key, value, attention_mask, **kwargs):
            return super().forward(query * 1.5, key, value, attention_mask, **kwargs)

    return {"own-init": (ScaledCore, "sets itself up in an __init__ of its own"),
            "kwargs-forward": (TemperedCore, "takes packed_seq_params: what it reads of them is its own")}


@pytest.mark.parametrize("case", ["own-init", "kwargs-forward"])
def test_a_core_of_its_own_is_refused_by_name_and_never_runs_a_plan(megatron_cpu, case):
    """Each case failed here on 9e804589 (check_shared_prefix accepted the model; the planned call ran).
    Now the check names the class, its path and why; a model prepared without the check refuses at its
    first planned call (prepare_shared_prefix left the core as it is) and runs as before without a plan."""
    core, why = _own_cores()[case]
    model = _with_core(core)
    name = f"{core.__module__}.{core.__qualname__}"
    message = _refusal(model, training=True)
    assert f"a module the plan does not know ({name} at decoder.layers.0.self_attention.core_attention takes " \
           f"packed_seq_params" in message and why in message, message
    batch = grpo_batch(((45, (5, 8, 2)),), (6,), padding=3)
    want = scores(ordinary(model, batch), batch)[0]
    with pytest.raises(ValueError, match=rf"^shared prefix: the core attention {name} of SelfAttention is not one the "
                                         "plan knows"):
        planned(model, batch)
    assert torch.equal(scores(ordinary(model, batch), batch)[0], want)  # prepared, the ordinary call unchanged
    assert type(model.decoder.layers[0].self_attention.core_attention) is core


# Issue 119 item 3: fields check_shared_prefix refuses, which a prepared model's planned call refused not at all on
# 9e804589 (measured there against the same samples packed whole, this test's batch: capacity factor 1.0 with or
# without padding to capacity, log-probs 6.9e-3 and gradients 0.21 off; router jitter 1.8e-5 and 1.8e-3):
# (overrides, field words)
FIRST_CALL = {
    "capacity-factor": ({**MOE, "moe_expert_capacity_factor": 1.0, "moe_token_drop_policy": "probs"},
                        "MoE token dropping (moe_expert_capacity_factor=1.0)"),
    "pad-to-capacity": ({**MOE, "moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True},
                        "MoE token dropping (moe_expert_capacity_factor=1.0)"),
    "router-jitter": ({**MOE, "moe_input_jitter_eps": 0.01}, "MoE router input jitter (moe_input_jitter_eps=0.01)"),
}


@pytest.mark.parametrize("case", sorted(FIRST_CALL))
def test_a_prepared_model_refuses_at_its_first_planned_call_what_the_check_refuses(megatron_cpu, moe_router_on_cpu,
                                                                                    case):
    """A loop that calls the model without check_shared_prefix (each case ran silently on 9e804589): the
    planned call raises the check's words, naming the field, before the model computes; a forward-only pass
    where the field runs exact (jitter without gradients) and every call without a plan run as before."""
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    overrides, words = FIRST_CALL[case]
    model = build_packed_gpt(seq_length=256, seed=5, config=tiny_gpt_config(**overrides))
    assert words in _refusal(model, training=True)
    batch = grpo_batch(((45, (5, 8, 2)),), (6,), padding=3)
    embedded = []
    model.embedding.register_forward_pre_hook(lambda module, args: embedded.append(1))
    with pytest.raises(ValueError, match=rf"^shared prefix: {re.escape(words)}: .* \(this model's config, which "
                                         r"check_shared_prefix refuses before the pass\): do not pack"):
        planned(model, batch)
    assert not embedded  # refused before the model computed anything (and before any collective)
    ordinary(model, batch)
    if case == "router-jitter":  # in training only: a forward-only pass runs it, the same model
        with torch.no_grad():
            planned(model, batch)
        assert len(embedded) == 2


def test_a_hand_written_loop_is_told_not_to_plan_and_a_framework_door_names_the_setting(megatron_cpu, caplog,
                                                                                         clean_patch_state):
    from megatron_rl_patches.integrations.megatron.shared_prefix_pass import prefix_pass
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    model = build_packed_gpt(seq_length=256, config=tiny_gpt_config(attention_dropout=0.1))
    message = _refusal(model, training=True)
    assert message.endswith("Do not pack its micro-batches by shared prefix (call plan_shared_prefix only for models "
                            "check_shared_prefix accepts)")
    assert "MEGATRON_RL_PATCHES_SHARED_PREFIX" not in message
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        assert prefix_pass("slime's training step", [model], training=True, enabled=True) is None
    assert "runs each sample packed whole: attention dropout in training (attention_dropout=0.1)" in caplog.text
    assert "(MEGATRON_RL_PATCHES_SHARED_PREFIX=0 switches sharing off for this job" in caplog.text


def test_the_docs_name_every_checked_field():
    from pathlib import Path

    from megatron_rl_patches.shared_prefix.known_config import FIELDS

    page = (Path(__file__).parents[2] / "docs" / "shared-prefix.md").read_text()
    missing = [name for name, known in FIELDS.items() if known.what and f"`{name}`" not in page]
    assert not missing, f"docs/shared-prefix.md's table of what the plan checks lacks {missing}"


def test_the_language_models_own_position_embedding_and_a_field_without_a_default_are_read(megatron_cpu):
    """local_reasons reads the embedding off the model (GPTModel's argument, not a config field: the
    same model set to 'mrope' is refused by name); a field no config gives a default is refused
    whatever its value, None included."""
    from types import SimpleNamespace

    from megatron_rl_patches.shared_prefix.known_config import unknown
    from megatron_rl_patches.shared_prefix.refusals import config_reasons, local_reasons
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    model = build_packed_gpt(seq_length=64, seed=3, config=tiny_gpt_config())
    assert local_reasons(model, False) == []
    model.position_embedding_type = "mrope"
    reasons = local_reasons(model, False)
    assert len(reasons) == 1 and "(position_embedding_type='mrope'): " in reasons[0], reasons
    own = SimpleNamespace(a_field_of_its_own=None)
    assert config_reasons(own, False) == [unknown("a_field_of_its_own", None, None)]


def test_each_module_class_is_read_once_each_config_of_its_own_and_the_joined_reasons(megatron_cpu):
    """A refused class is named once, at its first path; a module's config of its own (not the
    language model's) is read too; a language model without a position embedding attribute runs;
    what is no model chunk is refused by name; the joined helpers pass `training` on."""
    import copy

    from megatron_rl_patches.shared_prefix.refusals import config_reason, local_reason, local_reasons, module_reason
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    model = build_packed_gpt(seq_length=64, seed=3, config=tiny_gpt_config())
    attentions = [layer.self_attention for layer in model.decoder.layers]
    assert len(attentions) >= 2
    for attention in attentions:
        attention.attention_type = "cross"
    name = f"{type(attentions[0]).__module__}.{type(attentions[0]).__qualname__}"
    assert module_reason("here", attentions[0]) == f"cross attention ({name} at here)"
    assert local_reasons(model, False) == [f"cross attention ({name} at decoder.layers.0.self_attention)"]
    for attention in attentions:
        del attention.attention_type
    own = copy.copy(model.config)
    own.window_size = (8, 4)
    model.decoder.layers[1].mlp.config = own
    reasons = local_reasons(model, False)
    assert len(reasons) == 1 and "(window_size=(8, 4)): " in reasons[0], reasons
    model.decoder.layers[1].mlp.config = model.config
    del model.position_embedding_type
    assert local_reasons(model, False) == [] and local_reason(model, False) is None
    with pytest.raises(TypeError) as refused:
        local_reasons(object(), False)
    assert str(refused.value) == "prepare_shared_prefix: expected megatron-core model chunks, got object"
    dropout = tiny_gpt_config(hidden_dropout=0.1)
    assert config_reason(dropout, False) is None
    assert "(hidden_dropout=0.1): " in str(config_reason(dropout, True))
    model.config.hidden_dropout = 0.1
    assert local_reason(model, False) is None and "(hidden_dropout=0.1): " in str(local_reason(model, True))


def test_multi_latent_attention_before_megatron_core_0_16_is_refused_naming_its_class_path_and_version(megatron_cpu):
    """megatron-core 0.13–0.15's MLA fails inside its own rotary embedding on packed input (the oldest
    lane runs this): refused by name, the class and where it sits, the version and the remedy."""
    from kit.latent_gpt import build_mla_gpt, mla_takes_packed_input, tiny_mla_config
    from megatron.core.package_info import __version__

    from megatron_rl_patches.shared_prefix.refusals import shared_prefix_reason

    if mla_takes_packed_input():
        pytest.skip(f"megatron-core {__version__} runs multi-latent attention under a plan")
    reason = shared_prefix_reason(build_mla_gpt(tiny_mla_config()), training=True)
    assert reason == (f"multi-latent attention on megatron-core {__version__} (megatron.core.transformer."
                      "multi_latent_attention.MLASelfAttention at decoder.layers.0.self_attention): tested exact on "
                      "0.16 and later; upgrade megatron-core or do not share this model's prefixes")
