"""What a shared-prefix plan knows of a megatron-core model's configuration: one entry per
TransformerConfig field (MLATransformerConfig's too, megatron-core 0.13-0.19) and the language
model's `position_embedding_type`, each with the values it runs exact and why any other is refused.

A plan computes a group's prompt once and lets each response see it. That is exact where a token's
result depends only on the tokens its own sample lets it see, causally, at its own position, and
where no statistic counts tokens (a prefix token stands for G). Most fields act on each token alone
(widths, weights, parallel layouts, kernels, precision, memory): `PER_TOKEN` and its kin take any
value. The rest are checked: `only(...)` lists the values tested exact (the default first),
`checked(...)` says it as a predicate (`kinds.fields`). A field that is on a config but not in
`FIELDS` is refused by name unless it holds its default: the plan runs only what it knows.

The rows here are the fields no one kind owns; a kind's own fields (MoE's, MLA's, MTP's, DSA's, the
windows' and sinks', the recurrent layers') are in its object (`kinds`), and `FIELDS` holds them all.

To allow another value once it is exact (a window in the package's attention, say), widen that
field's entry, say what tests it, and move its row in docs/shared-prefix.md."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches.shared_prefix.kinds import KINDS
from megatron_rl_patches.shared_prefix.kinds.fields import (
    UNTESTED,
    Known,
    Settings,
    checked,
    only,
    per_token,
    rows,
    zero,
)

SHAPE = per_token("a layer's widths, weights and per-token functions")
PARALLEL = per_token("how weights and each token's work are split and communicated; tested at TP = 2 with and "
                     "without SP, EP = 2, PP = 2")
PRECISION = per_token("number formats: exact to the format's rounding, as the packed path is (bf16 tested)")
KERNELS = per_token("which kernel computes a per-token function, or the core attention the plan replaces")
MEMORY = per_token("what is kept, recomputed or offloaded, never what is computed (full recompute tested)")
PLUMBING = per_token("callbacks, logging, initialization and checks: no token's value")
INFERENCE = per_token("inference engines only: a plan runs without an inference context")
MODULES = per_token("it chooses a layer's classes: a module the plan does not know is refused by its class")
WITHOUT_CP = per_token("how the core attention exchanges keys across context-parallel ranks: the plan's attention "
                       "replaces it (it gathers them)")
WITHOUT_MRoPE = per_token("only with position_embedding_type 'mrope', which is refused")
WITHOUT_GRAPHS = per_token("only with CUDA graphs, which are refused")
PIPELINE = checked(
    "1; any with variable_seq_lengths (PP = 2 tested)",
    lambda value, s, training: int(value or 1) == 1 or bool(s.get("variable_seq_lengths")),
    what="pipeline parallelism without variable_seq_lengths",
    why="a planned micro-batch's length is its own; set config.variable_seq_lengths=True")


def _dropout(name: str) -> Known:
    return checked("0 in training; any in forward-only passes",
                   lambda value, s, training: not training or zero(value),
                   what=f"{name} dropout in training",
                   why="a prefix's dropout mask would be drawn once for every sample sharing it, where each "
                       "sample packed whole draws its own; set it to 0 (RL post-training runs without dropout)")


def _context_parallel_served(s: Settings) -> bool:
    """Context parallelism where the plan's cut is tested: a GPTModel's dense or multi-latent attention, MoE
    (every statistic but Sinkhorn's, read by its own field), pipeline stages, an MTP block and a framework's
    own gated delta net layers (not a config field: their class, whose kind runs it so); no megatron-core
    recurrent layers, DSA, windows or sinks."""
    return (not s.get("experimental_attention_variant")
            and not s.get("window_size") and s.get("softmax_type") in (None, "vanilla"))




_ROWS: dict[str, Known] = {  # what a token sees: checked
    "context_parallel_size": checked(
        "1; 2 or more on a GPTModel with dense or multi-latent attention, MoE, pipeline stages "
        "(variable_seq_lengths), MTP and a framework's own gated delta net layers where its kind runs them so, "
        "without megatron-core's gated delta nets, "
        "DSA, windows or sinks (tested at CP = 2 and CP = 4; CP = 2 x TP = 2 + SP; MoE at CP = 2 x EP = 2, its "
        "statistics too, and at CP = 2 x TP = 2 + SP x EP = 2; MLA at CP = 2; CP = 2 x PP = 2, also with MLA and MoE "
        "together; MTP at CP = 2 x TP = 2 + SP (depth 2, zigzag and contiguous), beside MLA and MoE at CP = 2 and at "
        "CP = 2 x PP = 2; a framework's gated delta nets at CP = 2 and CP = 4)",
        lambda value, s, training: int(value or 1) == 1 or _context_parallel_served(s),
        what="context parallelism beside megatron-core's gated delta net or DSA, a sliding window or an attention sink",
        why="megatron-core's recurrent layers, DSA's key gather and masks, and the package's windows and sinks are not "
            "cut over context-parallel ranks (not tested); run these models with context_parallel_size=1 or without "
            "a sharing plan"),
    "hybrid_context_parallel": only(False, what="hybrid context parallelism", why=UNTESTED),
    "pipeline_model_parallel_size": PIPELINE,
    "virtual_pipeline_model_parallel_size": only(None, what="interleaved (virtual) pipeline stages", why=UNTESTED),
    "experimental_attention_variant": checked(
        "None; 'gated_delta_net' (megatron-core's GatedDeltaNet: tested at 1 rank, TP = 2, TP = 2 + SP, PP = 2); "
        "'dsa' (megatron-core 0.19's DSA on its torch path: tested at 1 rank and TP = 2 + SP); either at CP = 1 "
        "(context_parallel_size's check)",
        lambda value, s, training: value in (None, "gated_delta_net", "dsa"),
        what="an experimental attention variant the sharing plan does not know",
        why="only megatron-core's gated delta net and DSA are prepared and tested under a sharing plan; do not share "
            "this model's prefixes"),
    "fused_single_qkv_rope": only(False, what="megatron-core's fused qkv RoPE",
                                  why="it takes no packed input; set fused_single_qkv_rope=False"),
    "qk_clip": only(False, what="QK-clip",
                    why="it reads each core attention's largest logit, which the package's attention does not "
                        "record; set qk_clip=False"),
    "log_max_attention_logit": only(False, what="the largest attention logit's log",
                                    why="the package's attention does not record it; set it to False"),
    "heterogeneous_block_specs": only(False, what="per-layer configurations", why=UNTESTED),
    "enable_cuda_graph": only(False, what="CUDA graphs",
                              why="a graph replays the stream it captured; each micro-batch's plan has its own"),
    "external_cuda_graph": only(False, what="CUDA graphs",
                                why="a graph replays the stream it captured; each micro-batch's plan has its own"),
    "cuda_graph_impl": only("none", what="CUDA graphs",
                            why="a graph replays the stream it captured; each micro-batch's plan has its own"),
    "hidden_dropout": _dropout("hidden"),
    "attention_dropout": _dropout("attention"),
    "position_embedding_type": only("rope", "yarn", "learned_absolute", "none", what="this position embedding",
                                    why="the plan reads rope, YaRN and learned positions at each token's own "
                                        "position; the multimodal rotary embedding (mrope) is not read so"),
    "use_mup": only(False, what="MuP scaling", why=UNTESTED),
}

_GROUPS: dict[Known, str] = {
    SHAPE: """num_layers hidden_size num_attention_heads num_query_groups ffn_hidden_size kv_channels softmax_scale
        add_bias_linear add_qkv_bias gated_linear_unit activation_func glu_linear_offset activation_func_clamp_value
        normalization layernorm_epsilon layernorm_zero_centered_gamma qk_layernorm qk_l2_norm attention_output_gate
        apply_residual_connection_post_layernorm rotary_interleaved no_rope_freq mtp_loss_scaling_factor
        moe_ffn_hidden_size moe_shared_expert_intermediate_size moe_shared_expert_gate moe_layer_freq moe_latent_size
        moe_apply_probs_on_input calculate_per_token_loss max_position_embeddings is_hybrid_model
        moe_shared_expert_glu_interleave_size moe_mlp_glu_interleave_size""",
    PARALLEL: """tensor_model_parallel_size pipeline_model_parallel_comm_backend sequence_parallel
        expert_model_parallel_size expert_tensor_parallel_size moe_extended_tp variable_seq_lengths
        num_layers_in_first_pipeline_stage num_layers_in_last_pipeline_stage pipeline_model_parallel_layout
        account_for_embedding_in_pipeline_split account_for_loss_in_pipeline_split pipeline_model_parallel_split_rank
        microbatch_group_size_per_vp_stage overlap_p2p_comm batch_p2p_comm batch_p2p_sync use_ring_exchange_p2p
        overlap_p2p_comm_warmup_flush deallocate_pipeline_outputs async_tensor_model_parallel_allreduce
        tp_comm_overlap tp_comm_bulk_wgrad tp_comm_bulk_dgrad tp_comm_overlap_ag tp_comm_overlap_rs
        tp_comm_overlap_rs_dgrad tp_comm_split_ag tp_comm_atomic_ag tp_comm_split_rs tp_comm_atomic_rs
        tp_comm_overlap_disable_qkv tp_comm_overlap_disable_fc1 tp_comm_bootstrap_backend
        overlap_moe_expert_parallel_comm delay_wgrad_compute ep_overlap_early_attn_memory_release
        defer_embedding_wgrad_compute wgrad_deferral_limit moe_token_dispatcher_type moe_enable_deepep
        moe_flex_dispatcher_backend moe_deepep_num_sms moe_hybridep_num_sms moe_shared_expert_overlap
        symmetric_ar_type tensor_parallel_num_weight_shards gtp_weight_remat_size
        expert_tensor_parallel_num_weight_shards expert_gtp_weight_remat_size
        overlap_dispatch_backward_with_experts_wgrad high_priority_a2a_comm_stream moe_permute_fusion_into_hybridep
        moe_hybridep_pad_uneven_dispatch_inputs moe_flex_dispatcher_num_sms moe_hybridep_num_blocks_permute
        moe_hybridep_num_blocks_unpermute moe_hybridep_num_sms_preprocessing moe_ncclep_static_shape
        moe_ncclep_zero_copy""",
    PRECISION: """fp16 bf16 params_dtype pipeline_dtype enable_autocast autocast_dtype fp32_residual_connection
        apply_query_key_layer_scaling attention_softmax_in_fp32 disable_bf16_reduced_precision_matmul
        fp8 fp8_recipe fp8_param fp8_quantizer_factory fp8_margin fp8_interval fp8_amax_history_len
        fp8_amax_compute_algo fp8_wgrad fp8_dot_product_attention fp8_multi_head_attention tp_only_amax_red
        first_last_layers_bf16 num_layers_at_start_in_bf16 num_layers_at_end_in_bf16 fp4 fp4_recipe fp4_param
        fp4_quantizer_factory quant_recipe activation_func_fp8_input_store fp8_output_proj""",
    KERNELS: """attention_backend gradient_accumulation_fusion cross_entropy_loss_fusion cross_entropy_fusion_impl
        bias_activation_fusion masked_softmax_fusion persist_layer_norm memory_efficient_layer_norm
        bias_dropout_fusion apply_rope_fusion use_fused_weighted_squared_relu use_te_activation_func moe_grouped_gemm
        moe_use_legacy_grouped_gemm moe_permute_fusion moe_router_fusion deterministic_mode batch_invariant_mode
        use_te_rng_tracker disable_parameter_transpose_cache clone_scatter_output_in_embedding flash_attention_version
        fused_residual_rmsnorm use_transformer_engine_op_fuser use_grouped_gemm_for_shared_expert
        use_grouped_gemm_for_dense_mlp moe_single_grouped_weight moe_single_grouped_bias""",
    MODULES: """transformer_impl use_kitchen use_kitchen_attention kitchen_attention_backend
        use_inference_optimized_layers hetereogenous_dist_checkpoint""",
    MEMORY: """recompute_granularity recompute_method recompute_num_layers distribute_saved_activations
        recompute_modules moe_layer_recompute num_microbatches_with_partial_activation_checkpoints cpu_offloading
        cpu_offloading_num_layers _cpu_offloading_context cpu_offloading_activations cpu_offloading_weights
        cpu_offloading_double_buffering fine_grained_activation_offloading offload_modules
        min_offloaded_tensor_size cpu_offloading_retain_pinned_cpu_buffers delay_offload_until_cuda_graph
        delta_offload_bytes_across_pp_ranks activation_offload_fraction moe_paged_stash moe_paged_stash_page_size
        moe_paged_stash_buffer_size_factor_cuda moe_paged_stash_buffer_size_factor_cpu
        fine_grained_offloading_max_inflight_offloads mlp_chunks_for_training""",
    PLUMBING: """perform_initialization use_cpu_initialization init_model_with_meta_device init_method
        output_layer_init_method init_method_std embedding_init_method embedding_init_method_std timers
        finalize_model_grads_func grad_scale_func no_sync_func grad_sync_func param_sync_func barrier_with_L1_time
        test_mode config_logger_dir moe_grad_scale_func mtp_grad_scale_func
        experimental_attention_variant_loss_scale_func""",
    INFERENCE: """flash_decode inference_rng_tracker inference_sampling_seed inference_fuse_tp_communication
        mlp_chunks_for_prefill cache_mla_latents moe_pad_experts_for_cuda_graph_inference inference_cuda_graph_scope
        nccl_all_reduce_for_prefill inference_disable_triton_nvls_kernels inference_grouped_gemm_backend
        inference_moe_disable_fused_quant_kernels inference_moe_token_dispatcher_type""",
    WITHOUT_CP: "hierarchical_context_parallel_sizes max_seqlen_per_dp_cp_rank cp_comm_type",
    per_token("only with use_mup, which is refused"): """mup_width_mult mup_base_hidden_size mup_embedding_mult
        mup_output_mult mup_base_head_dim mup_attn_scale_power""",
    per_token("only with qk_clip, which is refused"): "qk_clip_alpha qk_clip_threshold",
    WITHOUT_MRoPE: "mrope_section",
    WITHOUT_GRAPHS: """cuda_graph_use_single_mempool cuda_graph_retain_backward_graph cuda_graph_warmup_steps
        cuda_graph_scope cuda_graph_modules""",
}
FIELDS: dict[str, Known] = dict(_ROWS)  # every field: the rows no kind owns, each kind's, then the groups
for _table in (*(kind.fields for kind in KINDS), rows({}, _GROUPS)):
    for _name, _known in _table.items():
        FIELDS.setdefault(_name, _known)


def refusal(name: str, value: Any, known: Known) -> str:
    """A refused field's words: the feature, the field = value, why and what to do."""
    return f"{known.what} ({name}={value!r}): {known.why}"


def unknown(name: str, value: Any, default: Any) -> str:
    return (f"a setting the shared-prefix plan does not know ({name}={value!r}, default {default!r}): it may change "
            "what a token sees; leave it at its default or do not share this model's prefixes")
