"""Multi-token prediction (MTP) and HybridModel at TP=2, in one 2-rank gloo world for the module:
- a GPTModel with two MTP depths (native `process_mtp_loss` with patch `mtp_output_processor` on
  megatron-core >= 0.18; the GPT backport's inline fused heads before): the log-prob, top-k and
  divergence processors against the logits path (the main head's logits, megatron's MTP heads on
  logits) — values and every gradient, the MTP heads' included; the resident, swap and stream
  inference builds of the same provider, scored per micro-batch and layer-major, equal to it,
  building no [T, V/tp] tensor (the vocab watch; the logits path is its negative control);
- (megatron-core >= 0.18) a training step whose MTP loss runs through the fused head against
  megatron's `process_mtp_loss` on logits: loss, gradients, logged MTP losses;
- (megatron-core >= 0.18) HybridModel with `hybrid_output_processor`: every processor against its
  logits path, values and gradients.
Negative controls: wrong labels, another temperature, another beta, another MTP loss scale."""
from __future__ import annotations

import math

import pytest
from kit import logits_reference
from kit.builds import each_residency

from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error
from megatron_rl_patches.testing.multirank import run_multirank

pytestmark = [pytest.mark.megatron, pytest.mark.multirank, pytest.mark.slow]
TP = 2
V, B, S, K, H = 100, 2, 16, 4, 32  # V/tp = 50 differs from every other width of the tiny models
T = B * S
TILE = 8  # rows per logits tile (T = 32): a [T, V/tp] tensor is told apart from a tile
REL = 2e-6
REL_DIVERGENCE = 5e-5  # the fp32 divergence of small values against the float64 dense route
PROCESSORS = ("log-prob", "top-k", "divergence")
PATCHES = ["gpt_output_processor", "mtp_output_processor", "hybrid_output_processor"]








def _args(batch):
    return batch["tokens"], batch["position_ids"], batch["attention_mask"]


class _MainHeadLogits:
    """The main head's logits [b, s, V/tp] of the logits path: the output layer's last call in a
    forward (megatron's MTP heads call it before the main head, inline before 0.18 and in
    `process_mtp_loss` from 0.18), kept before megatron's cross-entropy overwrites them."""

    def __init__(self, model):
        self.logits = None
        self._handle = model.output_layer.register_forward_hook(self._keep)

    def _keep(self, module, args, output):
        # megatron's loss on the logits works in place on them: it gets a copy
        self.logits = output[0].transpose(0, 1)
        return (output[0].clone(), *output[1:])

    def close(self):
        self._handle.remove()


def _teacher(rank: int):
    """A teacher given by its hidden states [b, s, H] and this rank's shard of its output weight."""
    import torch

    hidden = torch.randn(B, S, H, generator=torch.Generator().manual_seed(80))
    weight = torch.randn(V, H, generator=torch.Generator().manual_seed(90)) / 4
    per = V // TP
    return {"teacher_hidden": hidden, "teacher_weight": weight[rank * per:(rank + 1) * per].contiguous(),
            "full_weight": weight}


def _processor(which: str, control: bool = False):
    from megatron_rl_patches import divergence_output_processor, log_prob_output_processor, topk_output_processor

    if which == "log-prob":
        return log_prob_output_processor(with_entropy=True, chunk_size=TILE)
    if which == "top-k":
        return topk_output_processor(k=K, temperature=0.8 if control else 1.0, chunk_size=TILE)
    return divergence_output_processor(divergence="jsd", beta=0.6 if control else 0.4, chunk_size=TILE)


def _values(which: str, out) -> tuple:
    """(values [b, s, ...], ids or None) of a processor's output."""
    import torch

    if which == "log-prob":
        return torch.stack([out["log_probs"], out["entropy"]], dim=-1), None
    if which == "top-k":
        return torch.cat([out["topk_log_probs"], out["tail"][..., None]], dim=-1), out["topk_ids"]
    return out, None


def _fused(which: str, model, batch, teacher, control: bool = False) -> tuple:
    """The processor's values (and top-k ids); labels always go in (megatron < 0.18 needs them with MTP)."""
    import torch

    labels = torch.roll(batch["labels"], 1, dims=1) if control and which == "log-prob" else batch["labels"]
    context = ({"teacher_hidden": teacher["teacher_hidden"], "teacher_weight": teacher["teacher_weight"]}
               if which == "divergence" else None)
    out = model(*_args(batch), labels=labels, output_processor=_processor(which, control),
                output_processor_context=context)
    return _values(which, out)


def _reference_from_logits(which: str, logits, batch, teacher, tp) -> tuple:
    """The same from the main head's logits [b, s, V/tp] (top-k at the ids their own top-k picks)."""
    import torch
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    rows, labels = logits.reshape(T, -1), batch["labels"].reshape(-1)
    if which == "log-prob":
        lp, ent = logits_reference.from_logits(which, rows, labels, K, tp_group=tp)
        return torch.stack([lp, ent], dim=-1).view(B, S, 2), None
    if which == "top-k":
        lp, tail, ids = logits_reference.from_logits(which, rows, labels, K, tp_group=tp)
        return torch.cat([lp, tail[:, None]], dim=-1).view(B, S, K + 1), ids.view(B, S, K)
    full = gather_from_tensor_model_parallel_region(rows)  # backward: this rank's slice
    teacher_rows = teacher["teacher_hidden"].reshape(T, H) @ teacher["full_weight"].T
    (dense,) = logits_reference.from_logits(which, full, labels, K, teacher_rows=teacher_rows)
    return dense.view(B, S).float(), None


def _scored(route, model, batch, weights) -> tuple:
    """(values, ids, every gradient) of a weighted sum of the route's values."""
    values, ids = route()
    (weights.view(B, S, *([1] * (values.dim() - 2))) * values).sum().backward()
    return values.detach(), ids, collect_grads(model)


def _logits_route(which, model, batch, teacher, weights, tp) -> tuple:
    head = _MainHeadLogits(model)
    try:
        def route():
            model(*_args(batch), labels=batch["labels"])  # the MTP heads' loss rides on the hidden states
            return _reference_from_logits(which, head.logits, batch, teacher, tp)

        return _scored(route, model, batch, weights)
    finally:
        head.close()


def _processor_checks(model, batch, teacher, weights, tp, refs) -> dict:
    """Each processor on the trainable MTP model against `refs` (the logits path), and its control."""
    import torch

    out = {}
    for which in PROCESSORS:
        values, ids, grads = _scored(lambda w=which: _fused(w, model, batch, teacher), model, batch, weights)
        want, want_ids, want_grads = refs[which]
        control, _, control_grads = _scored(lambda w=which: _fused(w, model, batch, teacher, control=True),
                                            model, batch, weights)
        out[which] = {"values": relative_error(values, want), "grads": grad_error(grads, want_grads),
                      "ids": ids is None or torch.equal(ids, want_ids),
                      "mtp grads": any(k.startswith("mtp.") and g.abs().sum() > 0 for k, g in grads.items()),
                      "control": max(relative_error(control, want), grad_error(control_grads, want_grads))}
    return out


def _mtp_build_checks(provider, batches, teacher, refs_by_batch) -> dict:
    """Resident, swap and stream builds of the MTP provider: every processor per micro-batch against
    the logits path's values, layer-major against per micro-batch (bit for bit), and the largest
    vocabulary-wide tensor while they score."""
    import torch

    from megatron_rl_patches.inference import score_layer_major
    from megatron_rl_patches.testing.vocab_watch import VocabWideTensors

    out = {}
    for mode, chunks in each_residency(provider):
        result = {"chunks": len(chunks), "mtp": any(n.startswith("mtp.") for n, _ in chunks[0].named_parameters())}
        with torch.no_grad(), VocabWideTensors(V // TP) as watch:
            for which in PROCESSORS:
                per_batch = [_fused(which, chunks[0], batch, teacher)[0] for batch in batches]
                context = ({"teacher_hidden": teacher["teacher_hidden"], "teacher_weight": teacher["teacher_weight"]}
                           if which == "divergence" else None)
                keywords = [{"input_ids": b["tokens"], "position_ids": b["position_ids"],
                             "attention_mask": b["attention_mask"], "labels": b["labels"]} for b in batches]
                layer_major = [_values(which, o)[0] for o in score_layer_major(
                    chunks, keywords, output_processor=_processor(which), output_processor_context=context)]
                result[which] = {
                    "values": max(relative_error(got, refs[which]) for got, refs in zip(per_batch, refs_by_batch)),
                    "layer-major bit for bit": all(torch.equal(a, b) for a, b in zip(layer_major, per_batch))}
        result["largest vocab-wide"] = watch.largest_shape
        out[mode] = result
    return out


def _mtp_loss_step(model, batch, loss_mask) -> tuple:
    """megatron's own training step with MTP (logits on the main head): loss, gradients, logged MTP losses."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker = {}
    loss = model(*_args(batch), labels=batch["labels"], loss_mask=loss_mask).mean()
    loss.backward()
    logged = {k: v.clone() for k, v in MTPLossLoggingHelper.tracker.items() if hasattr(v, "clone")}
    MTPLossLoggingHelper.tracker = {}
    return loss.detach(), collect_grads(model), logged


def _hybrid_model(env):
    """A tiny HybridModel (attention, MLP, attention, MLP) at TP=2."""
    import torch

    from megatron_rl_patches.testing import tiny_hybrid

    torch.manual_seed(8)
    return tiny_hybrid.build(env.config(num_layers=4, tensor_model_parallel_size=TP), "*-*-", vocab_size=V,
                             max_sequence_length=S)


def _logits_values(which, model, batch, teacher, tp):
    """The logits path's values alone (under no_grad)."""
    head = _MainHeadLogits(model)
    try:
        model(*_args(batch), labels=batch["labels"])
        return _reference_from_logits(which, head.logits, batch, teacher, tp)[0]
    finally:
        head.close()


def _mtp_world(rank: int, world_size: int) -> dict:
    import torch
    from megatron.core import parallel_state

    import megatron_rl_patches
    from megatron_rl_patches.ops.kernels import torch_tiles
    from megatron_rl_patches.testing.megatron_cpu import ModelKindUnavailable, make_batch, megatron_on_cpu
    from megatron_rl_patches.testing.mtp_gpt import tiny_mtp_config, tiny_mtp_provider
    from megatron_rl_patches.testing.vocab_watch import VocabWideTensors

    torch_tiles.MAX_TILE_ROWS = TILE
    out: dict = {}
    with megatron_on_cpu(tensor_parallel=world_size) as env:
        tp = parallel_state.get_tensor_model_parallel_group()
        provider = tiny_mtp_provider(tiny_mtp_config(tensor_model_parallel_size=world_size), vocab_size=V,
                                     seq_length=S, seed=5)
        model = provider()
        batches = [make_batch(B, S, V, seed=3 + i) for i in range(2)]
        batch, teacher = batches[0], _teacher(rank)
        weights = torch.randn(B, S, generator=torch.Generator().manual_seed(4))
        loss_mask = (torch.rand(B, S, generator=torch.Generator().manual_seed(6)) < 0.8).float()
        try:
            hybrid_env = env.with_kind("hybrid")
        except ModelKindUnavailable:
            hybrid_env = None
        native_mtp_loss = hasattr(__import__("megatron.core.transformer.multi_token_prediction",
                                             fromlist=["x"]), "process_mtp_loss")

        # the logits path, before any patch: megatron's MTP heads on logits
        with VocabWideTensors(V // TP) as logits_watch:
            refs = {which: _logits_route(which, model, batch, teacher, weights, tp) for which in PROCESSORS}
        out["logits path largest vocab-wide"] = logits_watch.largest_shape
        with torch.no_grad():
            refs_by_batch = [{which: _logits_values(which, model, b, teacher, tp) for which in PROCESSORS}
                             for b in batches]
        if native_mtp_loss:
            want_step = _mtp_loss_step(model, batch, loss_mask)
        if hybrid_env is not None:
            hybrid = _hybrid_model(hybrid_env)
            hybrid_refs = {which: _logits_route(which, hybrid, batch, teacher, weights, tp) for which in PROCESSORS}

        statuses = megatron_rl_patches.apply(only=PATCHES)
        out["statuses"] = {}
        for status in statuses:  # per patch: its targets' states (an optional alias may be n/a)
            out["statuses"].setdefault(status.name, set()).add(status.state)
        out["processors"] = _processor_checks(model, batch, teacher, weights, tp, refs)
        out["builds"] = _mtp_build_checks(provider, batches, teacher, refs_by_batch)
        if native_mtp_loss:
            got_step = _mtp_loss_step(model, batch, loss_mask)
            model.config.mtp_loss_scaling_factor = 0.31  # the control: another MTP loss scale
            other_step = _mtp_loss_step(model, batch, loss_mask)
            model.config.mtp_loss_scaling_factor = 0.3
            (want_loss, want_grads, want_logged), (got_loss, got_grads, got_logged) = want_step, got_step
            out["mtp loss"] = {
                "loss": relative_error(got_loss, want_loss), "grads": grad_error(got_grads, want_grads),
                "logged": sorted(got_logged) == sorted(want_logged) and bool(got_logged) and all(
                    relative_error(got_logged[k], want_logged[k]) <= REL for k in want_logged),
                "control": grad_error(other_step[1], want_grads)}
        if hybrid_env is not None:
            out["hybrid"] = _processor_checks(hybrid, batch, teacher, weights, tp, hybrid_refs)
    return out


@pytest.fixture(scope="module")
def mtp_world() -> list[dict]:
    return run_multirank(_mtp_world, TP, timeout=300)



def _skip_without(mtp_world, key: str, reason: str):
    if key not in mtp_world[0]:
        pytest.skip(reason)


@layouts.mark("mtp", "tp2")
@pytest.mark.parametrize("which", PROCESSORS)
def test_processors_with_mtp_heads_equal_the_logits_path(mtp_world, which):
    """Values, top-k ids and every gradient (the MTP heads' too: their loss rides on the main head's
    hidden states) on both TP ranks; the control (wrong labels, another temperature or beta) is seen."""
    for result in mtp_world:
        assert result["statuses"]["gpt_output_processor"] <= {"applied", "native"}, result["statuses"]
        check = result["processors"][which]
        tolerance = REL_DIVERGENCE if which == "divergence" else REL
        assert check["values"] <= tolerance and check["grads"] <= tolerance and check["ids"], check
        assert check["mtp grads"], check
        assert check["control"] > 1e-2, check


@layouts.mark("mtp", "tp2")
@pytest.mark.parametrize("mode", ["resident", "swap", "stream"])
def test_mtp_inference_builds_score_like_the_logits_path_without_vocab_wide_tensors(mtp_world, mode):
    """The build keeps the MTP block (its weights load from the same checkpoint; megatron's forward
    runs it); its heads go through the fused head, so scoring with a processor allocates logits
    tiles only, where the logits path allocates [T, V/tp] (the control)."""
    for result in mtp_world:
        build = result["builds"][mode]
        assert build["chunks"] == 1 and build["mtp"], build
        for which in PROCESSORS:
            assert build[which]["values"] <= (REL_DIVERGENCE if which == "divergence" else REL), (which, build)
        assert build["largest vocab-wide"] == (TILE, V // TP), build
        control = result["logits path largest vocab-wide"]  # rows x V/tp: every token's logits at once
        assert len(control) >= 2 and control[-1] == V // TP and math.prod(control[:-1]) >= T, control


@layouts.mark("mtp", "tp2")
@pytest.mark.parametrize("mode", ["resident", "swap", "stream"])
def test_mtp_layer_major_equals_per_micro_batch(mtp_world, mode):
    """score_layer_major over two micro-batches with each processor equals the per-micro-batch calls
    bit for bit (the MTP block runs in the model's own forward after the last layer)."""
    for result in mtp_world:
        build = result["builds"][mode]
        assert all(build[which]["layer-major bit for bit"] for which in PROCESSORS), build


@layouts.mark("mtp", "tp2")
def test_fused_mtp_loss_equals_process_mtp_loss_on_logits_at_tp2(mtp_world):
    """megatron-core >= 0.18: a training step whose MTP heads' loss runs through the fused head
    (patch `mtp_output_processor`) equals megatron's `process_mtp_loss` on logits: loss, every
    gradient, logged MTP losses; another MTP loss scale is seen (the control)."""
    _skip_without(mtp_world, "mtp loss", "megatron-core < 0.18 computes the MTP loss inline (no process_mtp_loss)")
    for result in mtp_world:
        states = result["statuses"]["mtp_output_processor"]  # 0.18 has no acceptance counts to patch: n/a
        assert "applied" in states and states <= {"applied", "n/a"}, result["statuses"]
        check = result["mtp loss"]
        assert check["loss"] <= REL and check["grads"] <= REL and check["logged"], check
        assert check["control"] > 1e-3, check


@layouts.mark("hybrid", "tp2")
@pytest.mark.parametrize("which", PROCESSORS)
def test_hybrid_model_processors_equal_the_logits_path_at_tp2(mtp_world, which):
    """megatron-core >= 0.18: HybridModel with `hybrid_output_processor`, every processor at TP=2."""
    _skip_without(mtp_world, "hybrid", "HybridModel needs megatron-core >= 0.18")
    for result in mtp_world:
        assert result["statuses"]["hybrid_output_processor"] <= {"applied", "native"}, result["statuses"]
        check = result["hybrid"][which]
        tolerance = REL_DIVERGENCE if which == "divergence" else REL
        assert check["values"] <= tolerance and check["grads"] <= tolerance and check["ids"], check
        assert check["control"] > 1e-2, check
