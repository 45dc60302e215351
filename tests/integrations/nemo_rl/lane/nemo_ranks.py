"""The NeMo-RL lane's rank functions: each world runs NeMo-RL 7ea279ab's own Megatron driver
(`get_microbatch_iterator` + `megatron_forward_backward` with its post-processors and losses) on a
tiny GPTModel, unpatched and patched, and returns its figures (errors, bytes) for the test to check.
Imported in each spawned rank: the service stand-ins are installed before NeMo-RL is imported."""
from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

from megatron_rl_patches.testing.service_stubs import install_service_stubs  # noqa: E402

install_service_stubs()

import nemo_kit as kit  # noqa: E402
import torch  # noqa: E402

PATCHES = ("nemo_rl_fused_logprobs", "nemo_rl_topk", "nemo_rl_topk_kd")


def _applied(names: tuple[str, ...], fn: Any) -> Any:
    import megatron_rl_patches

    megatron_rl_patches.apply(list(names), strict=True)
    try:
        return fn()
    finally:
        megatron_rl_patches.revert()


def _model(layout: dict, seed: int) -> Any:
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt
    from megatron_rl_patches.testing.pipeline import stage_flags

    config = tiny_gpt_config(tensor_model_parallel_size=layout["tp"], sequence_parallel=layout["sp"],
                             pipeline_model_parallel_size=layout["pp"], context_parallel_size=layout["cp"],
                             num_layers=2)
    first, last = stage_flags()
    return build_packed_gpt(vocab_size=kit.VOCAB, seq_length=64, seed=seed, config=config, pre_process=first,
                            post_process=last, context_parallel_layout="zigzag" if layout["cp"] > 1 else None)


def _last_stage() -> bool:
    from megatron_rl_patches.testing.pipeline import is_last_stage

    return is_last_stage()


def _cat(results: list, key: str) -> torch.Tensor | None:
    return torch.cat([r[key] for r in results]) if results else None


def _err(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    return 0.0 if a is None else float((a.double() - b.double()).abs().max())


def _drive(model, data, cfg, post, **kw) -> list:
    return kit.drive(model, data, cfg, post, mbs=2, **kw)


def _logprob_checks(model, cfg, out: dict) -> None:
    from nemo_rl.models.megatron.train import LogprobsPostProcessor

    from megatron_rl_patches.testing.vocab_watch import VocabWideTensors

    data = kit.batch(seed=1)
    post = LogprobsPostProcessor(cfg, None)
    own = _cat(_drive(model, data, cfg, post, temperature=kit.TEMPERATURE), "logprobs")
    vocab = kit.VOCAB // cfg["megatron_cfg"]["tensor_model_parallel_size"]
    with VocabWideTensors(vocab) as watch:
        fused = _applied(("nemo_rl_fused_logprobs",), lambda: _cat(
            _drive(model, kit.batch(seed=1), cfg, post, temperature=kit.TEMPERATURE), "logprobs"))
    with VocabWideTensors(vocab) as plain:
        _drive(model, kit.batch(seed=1), cfg, post, temperature=kit.TEMPERATURE)
    other = _applied(("nemo_rl_fused_logprobs",), lambda: _cat(
        _drive(model, kit.batch(seed=1), cfg, post, temperature=1.0), "logprobs"))
    out["logprobs_err"] = _err(own, fused)
    out["logprobs_control"] = _err(own, other)  # another temperature: the comparison can fail
    out["logprobs_bytes"] = (watch.largest_bytes, plain.largest_bytes)


def _topk_checks(model, cfg, out: dict) -> None:
    from nemo_rl.models.megatron.train import TopkLogitsPostProcessor

    post = TopkLogitsPostProcessor(cfg, kit.K)
    own = _drive(model, kit.batch(seed=2), cfg, post, temperature=kit.TEMPERATURE)
    ours = _applied(("nemo_rl_topk",), lambda: _drive(model, kit.batch(seed=2), cfg, post,
                                                       temperature=kit.TEMPERATURE))
    if not own:
        return
    own_logits, own_ids = _cat(own, "topk_logits"), _cat(own, "topk_indices")
    values, ids = _cat(ours, "topk_logits"), _cat(ours, "topk_indices")
    valid = torch.arange(kit.SEQ)[None] < torch.tensor(kit.LENGTHS)[:, None]
    # the same ids (order among ties aside) and, renormalized over them, the same log-probs
    order_own, order = own_ids.sort(-1), ids.sort(-1)
    out["topk_ids_equal"] = bool((order_own.values == order.values)[valid].all())
    renorm_own = torch.log_softmax(own_logits.double(), -1).gather(-1, order_own.indices)
    renorm = torch.log_softmax(values.double(), -1).gather(-1, order.indices)
    out["topk_err"] = float((renorm_own - renorm)[valid].abs().max())
    out["topk_mass_max"] = float(values.double().exp().sum(-1)[valid].max())  # whole-vocab log-probs: <= 1
    out["topk_control"] = float((own_logits.double() - values.double())[valid].abs().max())  # raw logits differ


def _teacher_topk(cfg, layout, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The teacher's top-k through NeMo-RL's TopkLogitsPostProcessor on `nemo_rl_topk` (log-probs)."""
    from nemo_rl.models.megatron.train import TopkLogitsPostProcessor

    teacher = _model(layout, seed)
    results = _applied(("nemo_rl_topk",), lambda: _drive(teacher, kit.batch(seed=3), cfg,
                                                          TopkLogitsPostProcessor(cfg, kit.K)))
    values = _cat(results, "topk_logits") if results else torch.zeros(kit.BATCH, kit.SEQ, kit.K)
    ids = _cat(results, "topk_indices") if results else torch.zeros(kit.BATCH, kit.SEQ, kit.K, dtype=torch.long)
    return _pp_broadcast(values), _pp_broadcast(ids)


def _pp_broadcast(value: torch.Tensor) -> torch.Tensor:
    """The last pipeline stage's tensor on every stage (the teacher's top-k reaches the student's
    data on every rank, as NeMo-RL's driver hands it)."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return value
    group = parallel_state.get_pipeline_model_parallel_group()
    last = parallel_state.get_pipeline_model_parallel_last_rank()
    value = value.contiguous()
    torch.distributed.broadcast(value, src=last, group=group)
    return value


class SpyDistillation:
    """NeMo-RL's own DistillationLossFn, its inputs kept (the student's top-k log-probs)."""

    def __init__(self, cfg) -> None:
        from nemo_rl.algorithms.loss.loss_functions import DistillationLossFn

        self.inner = DistillationLossFn(cfg)
        self.loss_type, self.input_type = self.inner.loss_type, self.inner.input_type
        self.zero_outside_topk, self.kl_type = self.inner.zero_outside_topk, self.inner.kl_type
        self.mixed_kl_weight = self.inner.mixed_kl_weight
        self.seen: list[torch.Tensor] = []

    def __call__(self, **kwargs):
        self.seen.append(kwargs["student_topk_logprobs"].detach())
        return self.inner(**kwargs)


def _float64_kl(student: torch.Tensor, teacher: torch.Tensor, kl_type: str, weight: float) -> torch.Tensor:
    """The (k+1)-bucket KL in float64 from whole-vocabulary top-k log-probs of both sides."""
    p, q = student.double(), teacher.double()
    p_tail = torch.log1p(-p.exp().sum(-1).clamp(max=1 - 1e-12))
    q_tail = torch.log1p(-q.exp().sum(-1).clamp(max=1 - 1e-12))
    p, q = torch.cat([p, p_tail[..., None]], -1), torch.cat([q, q_tail[..., None]], -1)
    forward = (q.exp() * (q - p)).sum(-1)
    reverse = (p.exp() * (p - q)).sum(-1)
    return {"forward": forward, "reverse": reverse}.get(kl_type, weight * forward + (1 - weight) * reverse)


def _masked(per_token: torch.Tensor, data) -> torch.Tensor:
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    return (per_token * mask).sum() / mask.sum()


def _kd_checks(model, cfg, layout, out: dict) -> None:
    from nemo_rl.algorithms.loss.loss_functions import DistillationLossConfig
    from nemo_rl.models.megatron.train import LossPostProcessor

    teacher = _teacher_topk(cfg, layout)
    for kl_type in ("forward", "reverse", "mixed"):
        spy = SpyDistillation(DistillationLossConfig(kl_type=kl_type, mixed_kl_weight=0.3, zero_outside_topk=True))
        own = _drive(model, kit.batch(seed=3, teacher=teacher), cfg, LossPostProcessor(spy, cfg, num_microbatches=2),
                     forward_only=True)
        patched = LossPostProcessor(SpyDistillation(DistillationLossConfig(kl_type=kl_type, mixed_kl_weight=0.3)),
                                    cfg, num_microbatches=2)
        exact = _applied(("nemo_rl_topk_kd",), lambda post=patched: _drive(
            model, kit.batch(seed=3, teacher=teacher), cfg, post, forward_only=True))
        if not own:
            continue
        data = kit.batch(seed=3, teacher=teacher)
        student = _student_rows(spy.seen, cfg)
        reference = _masked(_float64_kl(student, teacher[0][:, :-1], kl_type, 0.3), data)
        got = sum(float(r["loss"]) for r in exact)  # each micro-batch its share of the global mean
        own_loss = sum(float(r["loss"]) for r in own)
        out[f"kd_{kl_type}"] = {"exact": got, "float64": float(reference), "nemo_rl_own": own_loss}


def _student_rows(seen: list[torch.Tensor], cfg) -> torch.Tensor:
    """NeMo-RL's own student top-k log-probs (unpacked: [mbs, S−1, k] per micro-batch; packed: one
    sequence at a time, padded to S−1) as [B, S−1, k]."""
    if not cfg["sequence_packing"]["enabled"]:
        return torch.cat(seen)
    rows = torch.zeros(kit.BATCH, kit.SEQ - 1, kit.K, dtype=seen[0].dtype)
    for index, value in enumerate(seen):
        count = min(value.shape[1], kit.SEQ - 1)
        rows[index, :count] = value[0, :count]
    return rows


def _grpo_checks(model, cfg, out: dict) -> None:
    from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossConfig, ClippedPGLossFn
    from nemo_rl.models.megatron.train import LossPostProcessor

    loss_fn = ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.05))

    def step() -> tuple[float, list[torch.Tensor]]:
        for param in model.parameters():
            param.grad = None
        results = _drive(model, kit.batch(seed=4), cfg, LossPostProcessor(loss_fn, cfg, num_microbatches=2),
                         forward_only=False, temperature=kit.TEMPERATURE)
        loss = sum(float(r["loss"]) for r in results) if results else 0.0
        return loss, [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in model.parameters()]

    own_loss, own_grads = step()
    loss, grads = _applied(("nemo_rl_fused_logprobs",), step)
    out["grpo_loss"] = (own_loss, loss)
    out["grpo_grad_err"] = max(_err(a, b) for a, b in zip(own_grads, grads))
    out["grpo_grad_scale"] = max(float(a.abs().max()) for a in own_grads)


def _residency_checks(cfg, layout, out: dict) -> None:
    """The teacher's get_topk_logits route (NeMo-RL's driver with its TopkLogitsPostProcessor on
    `nemo_rl_topk`) on a teacher the package builds in host memory (`build_inference_model(...,
    residency="stream")`: each layer's weights copied in for its forward only): the same top-k as
    the teacher built resident, bit for bit."""
    from nemo_rl.models.megatron.train import TopkLogitsPostProcessor

    from megatron_rl_patches import build_inference_model
    from megatron_rl_patches.inference.residency import residency_report

    def provider(pre_process: bool = True, post_process: bool = True) -> Any:
        return _model(layout, seed=7)

    def topk(teacher: Any) -> list:
        return _applied(("nemo_rl_topk",), lambda: _drive(teacher, kit.batch(seed=3), cfg,
                                                           TopkLogitsPostProcessor(cfg, kit.K)))

    resident = topk(build_inference_model(provider)[0])
    streamed_model = build_inference_model(provider, residency="stream")
    streamed = topk(streamed_model[0])
    report = residency_report(streamed_model)
    same = all(torch.equal(a[key], b[key]) for a, b in zip(resident, streamed) for key in a)
    out["residency"] = {"same": same and len(resident) == len(streamed),
                        "peak_device_weight_bytes": report.peak_device_weight_bytes,
                        "resident_weight_bytes": report.resident_weight_bytes, "copies": report.copies}


def layout_world(rank: int, world: int, layouts: list[dict]) -> list[dict]:
    """Every check at each layout of `layouts`, in one spawned world (parallel state rebuilt per layout)."""
    import nemo_rl.models.megatron.train  # noqa: F401 - loaded before the shims: they unpin torch.tensor where it is

    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    results = []
    for layout in layouts:
        with megatron_on_cpu(tensor_parallel=layout["tp"], pipeline_parallel=layout["pp"],
                             context_parallel=layout["cp"]):
            out: dict[str, Any] = {"layout": layout["name"], "last_stage": _last_stage()}
            cfg = kit.policy_cfg(packed=layout["packed"], tp=layout["tp"], sp=layout["sp"], pp=layout["pp"],
                                 cp=layout["cp"])
            model = _model(layout, seed=0)
            _logprob_checks(model, cfg, out)
            _topk_checks(model, cfg, out)
            _grpo_checks(model, cfg, out)
            _kd_checks(model, cfg, layout, out)
            if layout.get("residency"):
                _residency_checks(cfg, layout, out)
            results.append(out)
    return results


def layout(name: str, tp: int = 1, sp: bool = False, pp: int = 1, cp: int = 1, packed: bool = False,
           residency: bool = False) -> dict:
    return {"name": name, "tp": tp, "sp": sp, "pp": pp, "cp": cp, "packed": packed, "residency": residency}
