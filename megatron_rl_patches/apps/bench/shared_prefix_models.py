"""`bench shared-prefix --shape hybrid|deepseek|cp2|models`: a group's prompt once against the same
model unshared, on three kinds of model slime ships, one GRPO group (P = 1,024, R = 128, G = 8) each:

- `hybrid` (Qwen3.5 / Qwen3-Next): a GPTModel of megatron-core's own gated delta nets, 3 of every 4
  layers, the 4th self-attention (`testing.gdn_gpt`, its torch rule on CPU). megatron-core's
  GatedDeltaNet refuses packed input, so its unshared row is megatron-core's ordinary call on the G
  samples batched unpacked, [G, P + R] (one recurrence over the batch, the local causal attention),
  the fastest way megatron-core itself runs them;
- `deepseek` (DeepSeek-V3, Kimi-K2, GLM-4.7-Flash): multi-latent attention (unfused YaRN RoPE), MoE
  with a sigmoid router, expert bias updated and a sequence aux loss (the router's statistics on in
  training), MTP of depth 1; unshared: the packed path with a plan that shares nothing (each sample
  attending to itself, the dense row's unshared path), the MTP block each depth's stream of its plan
  (`shared_prefix.mtp`: the prompt shared one row shorter; each sample's own rows on the unshared
  route; both routes' attention the package's, over each plan);
- `cp2`: the dense model at context parallelism 2 (2 gloo ranks spawned by the bench, the ids cut
  zigzag per sequence as megatron-core cuts them), against the same unshared at CP = 2; the CPU time
  summed over both ranks, the activations kept by the rank keeping more.

Each row as `bench shared-prefix`'s (`shared_prefix.COLUMNS`), one table: the two routes alternate
over rounds after a warm-up round (none in `--quick`), one torch thread per process."""
# lazy imports: import cost: torch and megatron-core load when a benchmark runs
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from megatron_rl_patches.apps.bench import outputs
from megatron_rl_patches.apps.bench.benchmark_run import run_benchmark
from megatron_rl_patches.apps.bench.progress import CaseLines
from megatron_rl_patches.apps.bench.shared_prefix import (
    BARS,
    COLUMNS,
    SHARED,
    UNSHARED,
    cpu_name,
    micro_batch,
    one_pass,
)
from megatron_rl_patches.apps.bench.shared_prefix_rows import timed_row
from megatron_rl_patches.apps.quiet import hide_import_notes

MODELS = ("hybrid", "deepseek", "cp2")
SHAPES = (*MODELS, "models")  # `models`: the three in one table
CASE = (1024, 128, 8)
# narrower than the dense row's 4 x 512 (the bench's time); the group and (but DeepSeek's) the vocabulary as its
FULL: dict[str, Any] = {"layers": 4, "hidden": 256, "heads": 4, "groups": 2, "vocab": 16384, "rounds": 2,
                        "warm_up": 1, "case": CASE, "experts": 8, "topk": 2, "mtp": 1}
QUICK: dict[str, Any] = {"layers": 4, "hidden": 32, "heads": 4, "groups": 2, "vocab": 256, "rounds": 1,
                         "warm_up": 0, "case": (120, 8, 4), "experts": 4, "topk": 2, "mtp": 1}
CP_SIZE = 2
# DeepSeek-V3's vocabulary against its width (129,280 / 7,168): its MTP head scores every row on both routes
DEEPSEEK_VOCAB_PER_HIDDEN = 18
UNSHARED_NOTE = {"hybrid": "megatron-core's call, samples batched unpacked [G, P+R]",
                 "deepseek": "packed, a plan sharing nothing",
                 "cp2": "packed at CP = 2, a plan sharing nothing"}
TITLES = {"hybrid": "Qwen3.5-shaped hybrid: gated delta nets 3:1 with attention",
          "deepseek": "DeepSeek-shaped: MLA + MoE (expert bias, seq aux loss) + MTP 1, vocab 18 x hidden",
          "cp2": "dense at CP = 2 (zigzag, 2 gloo ranks)"}


def case_name(model: str, plan: dict) -> str:
    p, r, g = plan["case"]
    return f"{TITLES[model]}, P={p}, R={r}, G={g}"


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def output_processor_patched() -> Iterator[None]:
    import megatron_rl_patches

    megatron_rl_patches.apply(only="gpt_output_processor")  # the output_processor keyword before megatron-core 0.18
    try:
        yield
    finally:
        megatron_rl_patches.revert()


@contextlib.contextmanager
def moe_router_on_cpu() -> Iterator[None]:
    """megatron-core < 0.17 without Transformer Engine names `te_general_gemm` in its router without
    defining it: defined as absent while inside, as its import fallback meant."""
    from megatron.core.transformer.moe import moe_utils

    missing = not hasattr(moe_utils, "te_general_gemm")
    if missing:
        moe_utils.te_general_gemm = None
    try:
        yield
    finally:
        if missing:
            del moe_utils.te_general_gemm


def dense_config(plan: dict, **overrides: Any) -> Any:
    """The dense row's proportions (SwiGLU three times as wide, RMSNorm, query/key norms, no biases)."""
    import torch

    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config

    values: dict[str, Any] = dict(num_layers=plan["layers"], hidden_size=plan["hidden"],
                                  num_attention_heads=plan["heads"], num_query_groups=plan["groups"],
                                  kv_channels=plan["hidden"] // plan["heads"], ffn_hidden_size=3 * plan["hidden"],
                                  gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                                  normalization="RMSNorm", qk_layernorm=True, add_bias_linear=False,
                                  init_method_std=0.02)
    values.update(overrides)
    return tiny_gpt_config(**values)


def hybrid_model(plan: dict) -> Any:
    """Gated delta nets at layers 1-3 of every 4 (Qwen3-Next's proportions: key heads half the value
    heads, the key width the hidden size's half), build inside `gated_delta_net_on_cpu()`."""
    from megatron_rl_patches.testing.gdn_gpt import build_gated_delta_net_gpt, tiny_gated_delta_net_config

    head = plan["hidden"] // plan["heads"]
    config = tiny_gated_delta_net_config(
        num_layers=plan["layers"], hidden_size=plan["hidden"], num_attention_heads=plan["heads"],
        num_query_groups=plan["groups"], kv_channels=head, ffn_hidden_size=3 * plan["hidden"],
        linear_key_head_dim=head, linear_value_head_dim=head, linear_num_key_heads=plan["heads"] // 2,
        linear_num_value_heads=plan["heads"], qk_layernorm=True, add_bias_linear=False, init_method_std=0.02)
    p, r, _ = plan["case"]
    return build_gated_delta_net_gpt(config, vocab_size=plan["vocab"], seq_length=p + r, seed=0)


def per_sample_attention_class() -> type:
    """The kit's packed-input core whose plain packed (`thd`) input runs each sequence on its own,
    causal (torch's SDPA), as Transformer Engine's core runs it on a GPU: a plain packed call then
    costs no dense [T, T] mask."""
    import torch

    from megatron_rl_patches.shared_prefix.kinds.kind import known_as
    from megatron_rl_patches.shared_prefix.kinds.plain_cores import PLAIN_CORES
    from megatron_rl_patches.testing.packed_gpt import packed_attention_class

    @known_as(PLAIN_CORES)  # each sample's plain causal attention: a plan runs it as its plain core
    class PerSampleAttention(packed_attention_class()):  # type: ignore[misc]
        def forward(self, query: Any, key: Any, value: Any, attention_mask: Any, attn_mask_type: Any = None,
                    attention_bias: Any = None, packed_seq_params: Any = None, **kwargs: Any) -> Any:
            if packed_seq_params is None or query.dim() != 3:
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                       packed_seq_params, **kwargs)
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = (packed_seq_params.cu_seqlens_q if cu is None else cu).tolist()
            repeat = query.size(1) // key.size(1)
            pieces = []
            for start, end in zip(cu[:-1], cu[1:]):
                q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))  # [heads, rows, d]
                if repeat > 1:
                    k, v = k.repeat_interleave(repeat, dim=0), v.repeat_interleave(repeat, dim=0)
                pieces.append(torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.softmax_scale).transpose(0, 1))
            return torch.cat(pieces).reshape(query.size(0), -1)

    return PerSampleAttention


def deepseek_vocab(plan: dict) -> int:
    return DEEPSEEK_VOCAB_PER_HIDDEN * plan["hidden"]


def deepseek_model(plan: dict) -> Any:
    """MLA (query and key/value latents, a rotary part of its own, YaRN), every MLP an MoE of
    `experts` routed top-`topk` by a sigmoid router with expert bias updated and a sequence aux
    loss, one MTP depth mirroring the layer; the kit's packed-input core attention."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_rl_patches.inference.loading.hf.families.mla import disarm_mocked_te_in_mla

    hidden, heads = plan["hidden"], plan["heads"]
    head = hidden // heads
    p, r, _ = plan["case"]
    config = MLATransformerConfig(
        num_layers=plan["layers"], hidden_size=hidden, num_attention_heads=heads, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, pipeline_dtype=torch.float32, init_method_std=0.02,
        normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, ffn_hidden_size=3 * hidden,
        multi_latent_attention=True, q_lora_rank=hidden // 2, kv_lora_rank=hidden // 4, qk_head_dim=head,
        qk_pos_emb_head_dim=head // 2, v_head_dim=head, qk_layernorm=True,
        rope_type="yarn", rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=1.0,
        original_max_position_embeddings=max(64, (p + r) // 4), apply_rope_fusion=False,
        num_moe_experts=plan["experts"], moe_router_topk=plan["topk"], moe_ffn_hidden_size=hidden,
        moe_token_dispatcher_type="allgather", moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-3,
        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4,
        mtp_num_layers=plan["mtp"] or None, mtp_loss_scaling_factor=0.1)
    disarm_mocked_te_in_mla()
    spec = get_gpt_layer_local_spec(num_experts=plan["experts"], moe_grouped_gemm=False, multi_latent_attention=True,
                                    qk_layernorm=True, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = per_sample_attention_class()
    torch.manual_seed(0)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=deepseek_vocab(plan),
                    max_sequence_length=p + r,
                    position_embedding_type="rope",
                    mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if plan["mtp"]
                    else None)


def cp_model(plan: dict) -> Any:
    """The dense model at context parallelism `CP_SIZE` (the kit's CPU context-parallel core, zigzag)."""
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    p, r, _ = plan["case"]
    return build_packed_gpt(vocab_size=plan["vocab"], seq_length=p + r, seed=0,
                            config=dense_config(plan, context_parallel_size=CP_SIZE),
                            context_parallel_layout="zigzag")


def plan_params(batch: Any, share: bool, cp: bool = False) -> Any:
    from megatron_rl_patches.shared_prefix import plan_shared_prefix, shared_prefix_params

    tokens, _, cu, _ = batch
    never = {} if share else {"min_shared": tokens.numel() + 1}
    plan = plan_shared_prefix(tokens, cu, pad_to=2 * CP_SIZE if cp else 1, **never)
    return shared_prefix_params(plan, cp_layout="zigzag") if cp else shared_prefix_params(plan)


def batched(batch: Any, group: int) -> Any:
    """The packed micro-batch unpacked: [G, P + R] (the G samples are of one length)."""
    tokens, labels, _, rows = batch
    return tokens.view(group, -1), labels.view(group, -1), None, rows.view(group, -1)


Pass = Callable[[bool], tuple[Any, tuple[float, float], int]]


def alternated(passes: dict[str, Pass], rounds: int, warm_up: int = 1) -> dict[str, dict[str, Any]]:
    """Each route's forward and training step over `rounds` after `warm_up` rounds, its bytes kept
    and its log-probs' largest |difference| from the first route's."""
    times: dict[str, dict[str, list]] = {route: {"forward": [], "train": []} for route in passes}
    saved: dict[str, int] = {}
    values: dict[str, Any] = {}
    for round_index in range(warm_up + rounds):
        for route, run_pass in passes.items():
            values[route], forward, _ = run_pass(False)
            _, train, saved[route] = run_pass(True)
            if round_index >= warm_up:
                times[route]["forward"].append(forward)
                times[route]["train"].append(train)
    first = values[next(iter(passes))]
    return {route: {**times[route], "saved": saved[route],  # a CP rank may hold no response row
                    "diff": float((values[route] - first).abs().max()) if first.numel() else 0.0} for route in passes}


def table_rows(case: str, measured: dict[str, dict[str, Any]], tokens: dict[str, int],
               notes: dict[str, str]) -> list[dict]:
    """`bench shared-prefix`'s rows of one case (ratios per round to the unshared route's CPU time)."""
    plain = measured[UNSHARED]
    rows = []
    for route, own in measured.items():
        rows.append(timed_row(case, route, tokens[route], own, plain, own["saved"], plain["saved"], own["diff"],
                              notes.get(route, "")))
    return rows


def measure_hybrid(plan: dict) -> tuple[dict, dict]:
    from megatron_rl_patches.shared_prefix import prepare_shared_prefix
    from megatron_rl_patches.testing.gdn_gpt import gated_delta_net_on_cpu
    from megatron_rl_patches.testing.megatron_cpu import megatron_world

    p, r, g = plan["case"]
    with megatron_world("cpu"), gated_delta_net_on_cpu():
        model = prepare_shared_prefix(hybrid_model(plan))
        batch = micro_batch(p, r, g, plan["vocab"])
        unpacked, shared = batched(batch, g), plan_params(batch, share=True)
        passes: dict[str, Pass] = {UNSHARED: functools.partial(one_pass, model, unpacked, None),
                                   SHARED: functools.partial(one_pass, model, batch, shared)}
        measured = alternated(passes, plan["rounds"], plan["warm_up"])
    return measured, {UNSHARED: g * (p + r), SHARED: shared.shared_prefix.physical_length}


def measure_deepseek(plan: dict) -> tuple[dict, dict]:
    from megatron_rl_patches.shared_prefix import prepare_shared_prefix
    from megatron_rl_patches.testing.megatron_cpu import megatron_world

    p, r, g = plan["case"]
    with megatron_world("cpu"), moe_router_on_cpu():
        model = prepare_shared_prefix(deepseek_model(plan))
        model.train()
        batch = micro_batch(p, r, g, deepseek_vocab(plan))
        params = {UNSHARED: plan_params(batch, share=False), SHARED: plan_params(batch, share=True)}
        passes: dict[str, Pass] = {route: functools.partial(one_pass, model, batch, params[route]) for route in params}
        measured = alternated(passes, plan["rounds"], plan["warm_up"])
    return measured, {route: params[route].shared_prefix.physical_length for route in params}


def cp_rank(rank: int, world_size: int, plan: dict) -> tuple[dict, dict]:
    """One context-parallel rank's measurement (`run_multirank`): its own zigzag share of the ids."""
    from megatron.core import parallel_state

    from megatron_rl_patches.ops.context_rows import local_rows
    from megatron_rl_patches.shared_prefix import prepare_shared_prefix
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    hide_import_notes()  # megatron-core's notes on this rank's CPU (the table's process hides its own)
    p, r, g = plan["case"]
    with one_thread(), output_processor_patched(), megatron_on_cpu(context_parallel=CP_SIZE):
        model = prepare_shared_prefix(cp_model(plan))
        tokens, labels, cu, rows = micro_batch(p, r, g, plan["vocab"])
        mine = local_rows("zigzag", parallel_state.get_context_parallel_rank(), CP_SIZE, cu_seqlens=cu)
        local = (tokens[:, mine], labels[:, mine], cu, rows[:, mine])
        params = {route: plan_params((tokens, labels, cu, rows), share=route == SHARED, cp=True)
                  for route in (UNSHARED, SHARED)}
        passes: dict[str, Pass] = {route: functools.partial(one_pass, model, local, params[route]) for route in params}
        measured = alternated(passes, plan["rounds"], plan["warm_up"])
    return measured, {route: params[route].shared_prefix.physical_length for route in params}


def measure_cp2(plan: dict) -> tuple[dict, dict]:
    """Both ranks' measurements as one: CPU time summed per round, wall time the slower rank's, the
    activations of the rank keeping more, the log-probs' largest difference on either."""
    from megatron_rl_patches.testing.multirank import run_multirank

    ranks = run_multirank(cp_rank, CP_SIZE, plan, timeout=1800)
    measured: dict[str, dict[str, Any]] = {}
    for route in ranks[0][0]:
        each = [rank[0][route] for rank in ranks]
        measured[route] = {kind: [(max(t[0] for t in per_round), sum(t[1] for t in per_round))
                                  for per_round in zip(*(own[kind] for own in each))] for kind in ("forward", "train")}
        measured[route]["saved"] = max(own["saved"] for own in each)
        measured[route]["diff"] = max(own["diff"] for own in each)
    return measured, ranks[0][1]


MEASURES: dict[str, Callable[[dict], tuple[dict, dict]]] = {
    "hybrid": measure_hybrid, "deepseek": measure_deepseek, "cp2": measure_cp2}


def measure_one(plan: dict, model: str) -> list[dict]:
    if model == "cp2":  # spawned ranks set their own thread and patch
        measured, tokens = MEASURES[model](plan)
    else:
        with one_thread(), output_processor_patched():
            measured, tokens = MEASURES[model](plan)
    return table_rows(case_name(model, plan), measured, tokens, {UNSHARED: UNSHARED_NOTE[model]})


def measure(plan: dict, models: tuple[str, ...]) -> list[dict]:
    """Each model's rows, or one row saying why it could not run (such rows first: no figure then)."""
    rows: list[dict] = []
    failed: list[dict] = []
    cases = CaseLines(len(models))
    for model in models:
        own = outputs.measured(functools.partial(measure_one, plan, model), "case")
        if "error" in own[0]:
            failed.append({**own[0], "case": case_name(model, plan)})
            cases.ended(f"{model}: {own[0]['note']}")
            continue
        rows += own
        cases.ended(f"{model}: the training step {own[1]['train_vs_unshared']:.2f}x the unshared one's CPU time, "
                    f"{own[1]['tokens']} tokens for {own[0]['tokens']}")
    return failed + rows


def vocabulary_words(plan: dict, models: tuple[str, ...]) -> str:
    """The vocabularies of `models` as the title says them: the DeepSeek-shaped model's is its own
    (DEEPSEEK_VOCAB_PER_HIDDEN x the width), every other model's the plan's."""
    own = f"{deepseek_vocab(plan)} ({DEEPSEEK_VOCAB_PER_HIDDEN} x hidden, DeepSeek-V3's proportion)"
    if models == ("deepseek",):
        return f"vocab {own}"
    return f"vocab {plan['vocab']}" + (f" (deepseek: {own})" if "deepseek" in models else "")


def described(plan: dict, models: tuple[str, ...]) -> str:
    hidden, heads = plan["hidden"], plan["heads"]
    return (f"shared-prefix packing on slime's model kinds ({', '.join(models)}): {plan['layers']} layers x {hidden} "
            f"hidden, {heads} heads of {hidden // heads}, {vocabulary_words(plan, models)}, fp32,\n{cpu_name()}, "
            f"one thread a process; {plan['rounds']} interleaved rounds")


def run(quick: bool = False, out_dir: str | None = None, shape: str = "models") -> list[dict]:
    """`bench shared-prefix --shape SHAPE` for SHAPE in `SHAPES`: writes shared_prefix_SHAPE.csv / .md / .png."""
    if shape not in SHAPES:
        raise ValueError(f"bench shared-prefix: a model shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    plan = QUICK if quick else FULL
    models = MODELS if shape == "models" else (shape,)
    return run_benchmark(f"shared_prefix_{shape}", lambda: measure(plan, models), "case", COLUMNS,
                         described(plan, models), BARS, quick, out_dir)
