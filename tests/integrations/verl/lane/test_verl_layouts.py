"""verl 0.9.1's real Megatron engine at the layouts of real jobs, in one 2-rank gloo world: TP=2,
TP=2 + SP and CP=2. verl's static context parallelism packs every sequence zigzag
(`MegatronEngine._get_context_parallel_layout`: "contiguous" only for DeepSeek-V4's hybrid
attention, whose PackedSeqParams field megatron-core 0.19.2 lacks), so CP=2 runs the kit's CPU
attention in the zigzag layout.

At each layout, on one model, verl's `forward_step` (its `preprocess_thd_engine` packing and CP
slicing, its fused or unfused forward, `postprocess_thd_engine`) and `postprocess_micro_batch_func`
with verl's `ppo_loss` (entropy bonus on):
- `verl_fused_logprobs` against verl's own unpatched logits path (use_fused_kernels=False): the
  log-probs and entropy verl reads, the loss and every gradient (summed over the CP ranks); the
  rows verl never reads are not computed (zero); log-probs and entropy against float64 of the
  model at TP=1/CP=1, and at CP=2 the summed gradients against the CP=1 model's.
- `verl_topk_kd` through verl's top-k distillation (`distillation_ppo_loss` as the logits processor
  and the loss): the per-token KL against the dense float64 (k+1)-bucket KL of the TP=1/CP=1
  model, and its gradients against the same dense KL computed in the same layout from verl's
  vocab-parallel logits.
- MEGATRON_RL_PATCHES_SHARED_PREFIX=1 through verl's real `forward_backward_batch` (at TP=1, TP=2
  and CP=2; `prefix_checks`): both routes' training step and the forward-only pass against the same
  passes packed whole, the embedding's rows against the samples' trie; MTP training (verl's own label
  roll) at TP=1 and CP=2; a verl setting the plan cannot run packed whole with one warning alike on
  every rank, and refused alike under MEGATRON_RL_PATCHES_STRICT=1.
Negative controls: a CP model whose attention reads the rows in the other layout than verl's
packing (contiguous) is far from float64; the dense KL without the tail buckets (verl's sum) too."""
from __future__ import annotations

import math

import pytest

from megatron_rl_patches.testing import layouts

pytest.importorskip("verl.models", reason="verl is not installed: run `make test-verl` (the verl lane)")
pytestmark = [pytest.mark.verl, pytest.mark.multirank]

import verl_kit as kit  # noqa: E402
from prefix_checks import (  # noqa: E402
    PREFIX_TOLERANCE,
    fallback_checks,
    mtp_checks,
    mtp_model,
    prefix_checks,
    strict_refusal,
)
from verl_kit import CONTROL, ENTROPY_COEFF, PROMPTS, REL, RESPONSES, TEMPERATURE  # noqa: E402

from megatron_rl_patches.testing.multirank import run_multirank  # noqa: E402

TOPK = 8
BF16_GRADS = 2.0 ** -8  # bf16 parameters hold bf16 gradients: one bf16 step of the largest
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
TP2 = dict(tensor_model_parallel_size=2)
# name: (megatron_on_cpu keywords, model config keywords, kit CP attention layout, layout markers)
LAYOUTS = {
    "tp2": (dict(tensor_parallel=2), TP2, None, ("tp2", "thd", "bshd")),
    "sp": (dict(tensor_parallel=2), dict(TP2, sequence_parallel=True), None, ("sp", "thd")),
    "cp2-zigzag": (dict(context_parallel=2), dict(context_parallel_size=2), "zigzag", ("cp2-zigzag", "thd")),
    "ep2": (dict(expert_parallel=2), dict(expert_parallel=2), None, ("ep2", "moe", "thd")),
    "recompute": (dict(tensor_parallel=2), dict(TP2, **RECOMPUTE), None, ("recompute", "tp2", "thd")),
    "bf16": (dict(tensor_parallel=2), dict(TP2, bf16=True), None, ("bf16", "tp2", "thd")),
}


def _model(name: str, attention: str | None = None):
    """The layout's model as verl's engine holds it: a packed GPTModel (MoE at ep2; bf16 in
    Float16Module), fused forward patched at build time as verl's engine does."""
    import torch
    from verl.models.mcore.model_forward_fused import patch_fused_forward

    from megatron_rl_patches.testing.megatron_cpu import build_tiny_gpt
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    config = dict(LAYOUTS[name][1]) if name in LAYOUTS else {}
    if name == "ep2":  # the kit's MoE spec with its CPU attention (at CP=1 it takes packed thd as is)
        from megatron_rl_patches.testing.cp_attention import cp_layer_spec
        from megatron_rl_patches.testing.moe_gpt import moe_layer_spec, tiny_moe_config

        model = build_tiny_gpt(tiny_moe_config(**config), cp_layer_spec("contiguous", moe_layer_spec()),
                               position_embedding_type="rope", vocab_size=kit.VOCAB, seq_length=64, seed=3)
    elif config.pop("bf16", False):
        from megatron.core.transformer.module import Float16Module

        config.update(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
        inner = build_packed_gpt(vocab_size=kit.VOCAB, seed=3, **config)
        model = Float16Module(inner.config, inner)
    else:
        model = build_packed_gpt(vocab_size=kit.VOCAB, seed=3, context_parallel_layout=attention, **config)
    patch_fused_forward(model)  # what verl's engine does at build time
    return model


def _policy_step(fused: bool, model, group=None) -> dict:
    """verl's forward_step + postprocess with ppo_loss: outputs, loss and gradients."""
    import functools

    from verl.workers.utils.losses import ppo_loss

    batch = kit.rl_batch(PROMPTS, RESPONSES, temperature=TEMPERATURE, calculate_entropy=True)
    loss_function = functools.partial(ppo_loss, kit.actor_config(ENTROPY_COEFF))
    output, loss = kit.train_step(kit.engine(fused), model, batch, loss_function)
    loss.backward()
    return {"log_probs": output["log_probs"].detach(), "entropy": output["entropy"].detach(),
            "loss": loss.detach(), "grads": kit.grads(model, group)}


def _teacher():
    """A teacher's top-k (nested [b, n, k] log-probs and ids) for every position of the batch."""
    import torch

    gen = torch.Generator().manual_seed(11)
    top = [torch.log_softmax(1.5 * torch.randn(p + r, kit.VOCAB, generator=gen), -1).topk(TOPK, -1)
           for p, r in zip(PROMPTS, RESPONSES)]
    return kit.nested([t.values for t in top]), kit.nested([t.indices for t in top])


def dense_forward_kl_topk(student_logits, data, data_format: str, tail: bool = True) -> dict:
    """verl's top-k logits-processor contract, computed densely in float64: the student's full
    logits (gathered over TP), the teacher's top-k split by verl's own `preprocess_thd_engine` /
    `preprocess_bshd_engine`, the (k+1)-bucket forward KL (`tail=False`: verl's top-k sum alone).
    Padding rows give 0."""
    import torch
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from verl.models.mcore.util import preprocess_bshd_engine, preprocess_thd_engine

    split = preprocess_thd_engine if data_format == "thd" else preprocess_bshd_engine
    log_p = torch.log_softmax(gather_from_tensor_model_parallel_region(student_logits).double(), dim=-1)
    q = split(data["teacher_logprobs"], pre_process=True)[0].double()
    ids = split(data["teacher_ids"], pre_process=True)[0]
    padded = (ids.sort(-1).values.diff(dim=-1) == 0).any(-1)  # verl's alignment rows: all-zero ids
    ids = torch.where(padded[..., None], torch.arange(TOPK).expand_as(ids), ids)
    q = torch.where(padded[..., None], torch.full_like(q, -math.log(TOPK + 1)), q)
    p = log_p.gather(-1, ids)
    kl = (q.exp() * (q - p)).sum(-1)
    if tail:
        q_tail, p_tail = torch.log1p(-q.exp().sum(-1)), torch.log1p(-p.exp().sum(-1))
        kl = kl + q_tail.exp() * (q_tail - p_tail)
    keep = (~padded).double()
    with torch.no_grad():
        overlap = (ids[..., None] == log_p.topk(TOPK, -1).indices[..., None, :]).any(-1) & ~padded[..., None]
        count = overlap.sum(-1)
        advantage = (-(q.exp() * (q - p)) * overlap).sum(-1) / count.clamp_min(1)
    return {"distillation_losses": kl * keep, "student_mass": p.exp().sum(-1) * keep,
            "teacher_mass": q.exp().sum(-1) * keep, "overlap_count": count, "overlap_token_advantage": advantage}


def _causal_padding_mask(module, args, kwargs):
    """verl's bshd batches carry a [b, s] padding mask (True: a token), which Transformer Engine's
    attention takes; megatron's local attention takes [b, 1, s, s] (True: masked): causal within
    the tokens."""
    import torch

    valid = kwargs.get("attention_mask")
    if isinstance(valid, torch.Tensor) and valid.dim() == 2:
        causal = torch.ones(valid.shape[1], valid.shape[1], dtype=torch.bool).tril()
        kwargs["attention_mask"] = ~(valid[:, None, :, None] & valid[:, None, None, :] & causal)
    return args, kwargs


def _distillation_step(model, dense: bool = False, tail: bool = True, group=None, thd: bool = True) -> dict:
    """verl's top-k distillation step (unfused forward: the logits processor gets the student's
    vocab-parallel logits; `thd=False`: verl's bshd batches, use_remove_padding=False): the
    per-token KL verl gathers and the gradients of its loss."""
    import functools

    from verl.trainer.distillation import distillation_ppo_loss

    log_probs, ids = _teacher()
    batch = kit.rl_batch(PROMPTS, RESPONSES, temperature=1.0, distillation_use_topk=True, distillation_only=True)
    batch["teacher_logprobs"], batch["teacher_ids"] = log_probs, ids
    config = kit.distillation_config(TOPK, use_task_rewards=False, use_policy_gradient=False, loss_max_clamp=None)
    loss_function = functools.partial(distillation_ppo_loss, config=kit.actor_config(), distillation_config=config)
    processor = functools.partial(dense_forward_kl_topk, tail=tail) if dense else loss_function
    eng = kit.engine(False)
    eng.engine_config.use_remove_padding = thd
    hook = None if thd else model.register_forward_pre_hook(_causal_padding_mask, with_kwargs=True)
    output, loss = kit.train_step(eng, model, batch, loss_function, processor)
    loss.backward()
    if hook is not None:
        hook.remove()
    return {"kl": kit.response_rows(output["distillation_losses"].detach(), PROMPTS), "grads": kit.grads(model, group)}


def _float64(model) -> dict:
    """float64 log-probs and entropy from the model's own logits, one sequence at a time."""
    batch = kit.rl_batch(PROMPTS, RESPONSES, temperature=TEMPERATURE)
    log_probs, entropies = kit.reference(model, batch, TEMPERATURE)
    return {"log_probs": [lp[p - 1:-1] for lp, p in zip(log_probs, PROMPTS)],
            "entropy": [e[p - 1:-1] for e, p in zip(entropies, PROMPTS)]}


def _references() -> dict:
    """At TP=1, CP=1 (the model the dense layouts split): float64 log-probs and entropy, verl's
    unpatched ppo_loss step (loss, gradients) and the dense float64 top-k KL."""
    import megatron_rl_patches

    model = _model("unsplit")
    megatron_rl_patches.revert()
    step = _policy_step(False, model)
    kl = _distillation_step(model, dense=True)["kl"]
    return {**_float64(model), "loss": step["loss"], "grads": step["grads"], "kl": kl}


def _unwrapped(model):
    return getattr(model, "module", model)  # Float16Module holds the GPTModel as .module


def _rows_error(got: list, want: list) -> float:
    return max(kit.relative(g, w) for g, w in zip(got, want))


def _grads_error(got: dict, want: dict) -> float:
    return max(kit.relative(got[name], want[name]) for name in want)


def _layout_checks(name: str, refs: dict) -> dict:
    import torch
    from megatron.core import parallel_state

    import megatron_rl_patches

    attention = LAYOUTS[name][2]
    group = parallel_state.get_context_parallel_group() if attention else None
    model = _model(name, attention)
    if name in ("ep2", "bf16"):  # another model than the unsplit one: float64 of its own logits
        refs = _float64(model)
    megatron_rl_patches.revert()
    plain = _policy_step(False, model, group)
    megatron_rl_patches.apply(only=["verl_fused_logprobs", "verl_topk_kd"])
    calls = []
    counter = _unwrapped(model).decoder.layers[0].register_forward_hook(lambda *_: calls.append(1))
    fused = _policy_step(True, model, group)
    counter.remove()
    # the rows verl reads (its trainer's batch reads no sequence's last row: that one is not computed)
    out = {key: _rows_error(kit.response_rows(fused[key], PROMPTS), kit.response_rows(plain[key], PROMPTS))
           for key in ("log_probs", "entropy")}
    out.update({f"{key}_float64": _rows_error(kit.response_rows(fused[key], PROMPTS), refs[key])
                for key in ("log_probs", "entropy")})
    out.update({
        "unread_rows": max(float(torch.cat([row[:p - 1], row[-1:]]).abs().max())
                           for row, p in zip(fused["log_probs"].unbind(), PROMPTS)),
        "loss": kit.relative(fused["loss"], plain["loss"]),
        "grads": _grads_error(fused["grads"], plain["grads"]),
        "same_names": sorted(fused["grads"]) == sorted(plain["grads"]) and len(plain["grads"]) > 4,
        "layer_calls": len(calls),  # forward, and again in backward under activation recompute
    })
    if "grads" in refs:  # the same weights as the unsplit model: its loss, and at CP its gradients
        out["loss_unsplit"] = kit.relative(fused["loss"], refs["loss"])
        if attention:  # the CP ranks' gradients add up to the unsplit model's
            out["grads_unsplit"] = _grads_error(fused["grads"], refs["grads"])
    for form in ("thd", "bshd") if name == "tp2" else ("thd",):
        thd = form == "thd"
        patched = _distillation_step(model, group=group, thd=thd)
        dense = _distillation_step(model, dense=True, group=group, thd=thd)
        suffix = "" if thd else "_bshd"
        out["kl" + suffix] = _rows_error(patched["kl"], dense["kl"])
        out["kl_grads" + suffix] = _grads_error(patched["grads"], dense["grads"])
        if "kl" in refs:
            out["kl_float64" + suffix] = _rows_error(patched["kl"], refs["kl"])
    no_tail = _distillation_step(model, dense=True, tail=False, group=group)
    out["control_no_tail"] = _rows_error(no_tail["kl"], dense["kl"])
    out["control_no_tail_grads"] = _grads_error(no_tail["grads"], dense["grads"])
    if attention:  # the other row layout than verl's packing: the attention sees the wrong neighbours
        import torch

        other = "contiguous" if attention == "zigzag" else "zigzag"
        with torch.no_grad():
            wrong = kit.forward_step(kit.engine(True), _model(name, other),
                                     kit.rl_batch(PROMPTS, RESPONSES, temperature=TEMPERATURE))
        wrong_rows = kit.response_rows(wrong["log_probs"], PROMPTS)
        out["control_wrong_layout"] = _rows_error(wrong_rows, refs["log_probs"])
    megatron_rl_patches.revert()
    return out


def _distopt_checks() -> dict:
    """DP=2, megatron-core's distributed optimizer with overlapped gradient reduce and parameter
    all-gather (the output weight alone in the bucket gathered last): verl's training step through
    the fused route and through its logits path give the same reduced gradients; after the
    optimizer step the next fused forward_step reads the gathered, updated output weight (equal to
    verl's logits path on the same weights, no all-gather left pending). Negative control: the
    weights did change (the log-probs before the step are told apart)."""
    import torch
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    import megatron_rl_patches
    from megatron_rl_patches.testing.megatron_cpu import wrap_ddp

    megatron_rl_patches.apply(only="verl_fused_logprobs")
    model = _model("unsplit")
    ddp = wrap_ddp(model, overlap_grad_reduce=True, use_distributed_optimizer=True, overlap_param_gather=True,
                   bucket_size=model.output_layer.weight.numel())
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.05, use_distributed_optimizer=True,
                                                       clip_grad=0.0), [ddp])
    reduced, before = {}, None
    for fused in (True, False):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        step = _policy_step(fused, ddp)
        ddp.finish_grad_sync()
        reduced[fused] = {name: p.main_grad.clone() for name, p in model.named_parameters()}
        before = step["log_probs"] if fused else before
    optimizer.step()
    batch = kit.rl_batch(PROMPTS, RESPONSES, temperature=TEMPERATURE, calculate_entropy=True)
    with torch.no_grad():
        after = kit.forward_step(kit.engine(True), ddp, batch)
        pending = any(group.param_gather_handle is not None for group in ddp.bucket_groups)
        plain = kit.forward_step(kit.engine(False), ddp, batch)
    megatron_rl_patches.revert()
    out = {key: _rows_error(kit.response_rows(after[key], PROMPTS), kit.response_rows(plain[key], PROMPTS))
           for key in ("log_probs", "entropy")}
    out.update(grads=_grads_error(reduced[True], reduced[False]), pending=pending,
               same_names=sorted(reduced[True]) == sorted(reduced[False]),
               control_before_the_step=_rows_error(kit.response_rows(before, PROMPTS),
                                                   kit.response_rows(plain["log_probs"], PROMPTS)))
    return out


def _world(rank: int, world_size: int) -> dict:
    import verl.models.mcore.registry  # noqa: F401  (bound by name before any patch: see verl_kit)

    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    with megatron_on_cpu():
        refs = _references()
    with megatron_on_cpu():  # DP=2
        results = {"distopt": _distopt_checks(), "prefix-tp1": prefix_checks(_model("tp1"), align=1),
                   "prefix-mtp": mtp_checks(mtp_model())}
    for name, (parallel, *_) in LAYOUTS.items():
        with megatron_on_cpu(**parallel):
            results[name] = _layout_checks(name, refs)
            if name == "tp2":
                results["prefix-tp2"] = prefix_checks(_model(name), align=2)
                results["prefix-fallback"] = fallback_checks(_model(name))
                results["prefix-strict"] = strict_refusal(_model(name))
            if name in ("ep2", "recompute"):  # MoE at EP = 2; the plan run again in backward
                results[f"prefix-{name}"] = prefix_checks(_model(name), align=2 if name == "recompute" else 1,
                                                          passes=("unfused-train",))
            if name == "cp2-zigzag":  # the whole micro-batch rebuilt from both ranks' zigzag shares
                results["prefix-cp2"] = prefix_checks(_model(name, "zigzag"), align=1, context=2)
                results["prefix-mtp-cp2"] = mtp_checks(mtp_model(context=2))
    return results


@pytest.fixture(scope="module")
def layouts_world() -> list[dict]:
    return run_multirank(_world, 2, timeout=300)


PARAMS = [pytest.param(name, id=name, marks=layouts.mark(*marks)) for name, (*_, marks) in LAYOUTS.items()]


FUSED = ("log_probs", "entropy", "loss", "grads", "log_probs_float64", "entropy_float64", "loss_unsplit",
         "grads_unsplit")


def _over(got: dict, keys, layout: str) -> dict:
    """The errors above their tolerance (fp32 rounding; bf16 rounding for bf16 gradients)."""
    def tolerance(key: str) -> float:
        return BF16_GRADS if layout == "bf16" and "grads" in key else REL

    return {key: got[key] for key in keys if key in got and not got[key] < tolerance(key)}


@pytest.mark.parametrize("layout", PARAMS)
def test_fused_route_equals_verls_logits_path_and_float64(layouts_world, layout):
    for rank, result in enumerate(layouts_world):
        got = result[layout]
        print(layout, rank, {key: got[key] for key in FUSED if key in got})
        assert got["same_names"] and {"log_probs", "entropy", "loss", "grads", "log_probs_float64"} <= set(got)
        assert not _over(got, FUSED, layout), (layout, rank)
        assert got["unread_rows"] == 0.0  # the rows verl never reads met no output weight
        # activation recompute ran the first layer again in backward (the other layouts: once)
        assert got["layer_calls"] == (2 if layout == "recompute" else 1)


@pytest.mark.parametrize("layout", PARAMS)
def test_topk_kd_equals_dense_float64(layouts_world, layout):
    for rank, result in enumerate(layouts_world):
        got = result[layout]
        kd = [key for key in got if key.startswith("kl")]
        print(layout, rank, {key: got[key] for key in kd})
        assert {"kl", "kl_grads"} <= set(kd), kd
        assert not _over(got, kd, layout), (layout, rank)
        # negative control: the dense KL without the tail buckets (verl's own sum) is told apart
        assert min(got["control_no_tail"], got["control_no_tail_grads"]) > CONTROL


@pytest.mark.parametrize("layout", [p for p in PARAMS if "cp" in p.id])
def test_a_wrong_cp_row_layout_is_far_from_float64(layouts_world, layout):
    for result in layouts_world:
        assert result[layout]["control_wrong_layout"] > CONTROL


@layouts.mark("distopt", "thd")
def test_distributed_optimizer_gathers_before_the_fused_route_reads(layouts_world):
    for result in layouts_world:
        got = result["distopt"]
        print(got)
        assert got["same_names"] and max(got["log_probs"], got["entropy"], got["grads"]) < REL, got
        assert not got["pending"]  # every parameter all-gather was waited for
        assert got["control_before_the_step"] > CONTROL  # the step changed the weights the route reads


@pytest.mark.parametrize("layout", [pytest.param("tp1", marks=layouts.mark("thd")),
                                    pytest.param("tp2", marks=layouts.mark("tp2", "thd")),
                                    pytest.param("cp2", marks=layouts.mark("cp2-zigzag", "thd")),
                                    pytest.param("ep2", marks=layouts.mark("ep2", "moe", "thd")),
                                    pytest.param("recompute", marks=layouts.mark("recompute", "tp2", "thd"))])
def test_shared_prefix_equals_each_sample_packed_whole_in_verls_passes(layouts_world, layout):
    """MEGATRON_RL_PATCHES_SHARED_PREFIX=1 against off, through verl's real forward_backward_batch:
    both routes' training step and forward-only pass the same within 1e-6 (fp32), every gradient
    too (summed over the CP ranks), and the embedding runs the samples' trie (as verl pads them)
    instead of every packed row; at CP = 2 each rank its half of either."""
    for rank, result in enumerate(layouts_world):
        got = result[f"prefix-{layout}"]
        print(layout, rank, got)
        for what in ("unfused-train", "fused-train", "unfused-forward"):
            if what not in got and layout in ("ep2", "recompute"):
                continue  # the unfused training step alone there
            checks = got[what]
            errors = {key: checks[key] for key in ("log_probs", "entropy", "loss", "grads") if key in checks}
            assert errors and max(errors.values()) < PREFIX_TOLERANCE, (what, errors)
            assert checks["rows_whole"] == [got["logical_rows"]], what
            assert checks["rows_planned"] == [got["trie_rows"]] and got["trie_rows"] < got["logical_rows"], what
            if "grads" in checks:
                assert checks["same_names"] and checks["control"] > CONTROL, what


@pytest.mark.parametrize("layout", [pytest.param("mtp", marks=layouts.mark("mtp", "thd")),
                                    pytest.param("mtp-cp2", marks=layouts.mark("mtp", "cp2-zigzag", "thd"))])
def test_mtp_training_on_a_sharing_plan_equals_each_sample_packed_whole(layouts_world, layout):
    """verl's MTP training (its own label roll and MTP loss) with the setting on against off: log-probs,
    entropy, the loss, the MTP loss verl logs and every gradient (the MTP block's too) within 1e-6; the
    embedding runs the samples' trie for the decoder and for the MTP depth (one token fewer shared)."""
    for result in layouts_world:
        got = result[f"prefix-{layout}"]
        print(layout, got)
        errors = {key: got[key] for key in ("log_probs", "entropy", "loss", "grads", "mtp_grads")}
        assert max(errors.values()) < PREFIX_TOLERANCE and got["same_names"], errors
        for whole, planned in got["mtp_losses"].values():  # on the rank that logs them
            assert abs(whole[0] - planned[0]) <= PREFIX_TOLERANCE * abs(whole[0]), got["mtp_losses"]
        (main, depth), (main_planned, depth_planned) = got["rows_whole"], got["rows_planned"]
        assert main == depth and main_planned < depth_planned < main, got


@layouts.mark("tp2", "thd")
def test_a_verl_setting_a_plan_cannot_run_packs_whole_with_one_warning_alike_on_every_rank(layouts_world):
    """router_replay.mode='R3' on both ranks: the pass runs as with the setting off (its log-probs bit for
    bit, every packed row at the embedding) and says why once, in verl's words, the same on both ranks."""
    first, second = (result["prefix-fallback"] for result in layouts_world)
    print(first)
    assert first["said"] == second["said"] and len(first["said"]) == 1, (first["said"], second["said"])
    for named in ("router_replay.mode", "actor_rollout_ref.actor.megatron.router_replay.mode=disabled",
                  "MEGATRON_RL_PATCHES_SHARED_PREFIX=0", "MEGATRON_RL_PATCHES_STRICT=1"):
        assert named in first["said"][0], named
    for got in (first, second):
        assert got["log_probs"] == 0.0 and got["rows"][0] == got["rows"][1] and got["rows"][0], got


def test_under_strict_a_verl_layout_a_plan_cannot_run_is_refused_alike_on_every_rank(layouts_world):
    """MEGATRON_RL_PATCHES_STRICT=1, each rank its own reason (rank 0: use_remove_padding=False, rank 1:
    router replay), agreed before the pass's first collective: one ValueError, the same on both ranks."""
    first, second = (result["prefix-strict"] for result in layouts_world)
    print(first)
    assert first == second
    for named in ("MEGATRON_RL_PATCHES_SHARED_PREFIX=1", "MEGATRON_RL_PATCHES_STRICT=1", "use_remove_padding=False",
                  "actor_rollout_ref.model.use_remove_padding=True", "router_replay.mode=disabled",
                  "MEGATRON_RL_PATCHES_SHARED_PREFIX=0"):
        assert named in first, named
