"""Re-entrant train() (F1) and accumulation windows (F2) at every parallel layout of docs/layouts.md,
on real megatron-core, 2 gloo ranks, in ONE spawn (`run_all`); test_train_layouts.py asserts on it.

Each layout builds its real model (GPTModel, the MoE GPTModel at EP = 2, MTP heads, HybridModel),
real DDP, megatron-core's real schedule; its microbatches are the same on every rank of a
model-parallel group (seeded by the data-parallel rank), cut to the rank's rows under context
parallelism.

- F1: the stand-in slime train() (tests/standins; DDP with overlap_grad_reduce, the distributed
  optimizer's flags and overlap_param_gather) called for 3 rollouts through `reentrant_train`,
  against the by-hand control (the config's sync functions and the hooks reset by hand between
  rollouts); the control's unpatched second call is recorded (upstream's assert).
- F2: 3 optimizer steps (Megatron's Adam) of 1, 2, 3 schedule calls with `grad_windows` ("patch")
  and with `accumulation_window` ("window") against the synchronous reference
  (overlap_grad_reduce=False, the same calls); "none": upstream with 2 calls then 1; "dropped": the
  patch with one microbatch left out of the last step.
A mode that raises records "ExceptionType: message" in place of its result."""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl_patches.testing.layouts import BY_MARKER

STANDINS = Path(__file__).resolve().parents[1] / "standins"
STEPS = [[1], [1, 1], [1, 1, 1]]  # windows: calls per optimizer step, one microbatch each
UPSTREAM_FAILS = [[1, 1], [1]]  # 2 calls then 1: upstream crashes on every version
DROPPED = [[1], [1, 1], [1, 1]]  # STEPS without the last call
ROLLOUTS, ROLLOUT_STEPS, MICROBATCHES = 3, 2, 2
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


@dataclass
class Layout:
    """One column of docs/layouts.md: the world's parallel sizes (testing/layouts.py), the config, the
    model and the rows."""

    world: dict = field(default_factory=dict)  # megatron_world keywords
    config: dict = field(default_factory=dict)  # tiny_gpt_config overrides
    model: str = "gpt"  # gpt, moe, mtp, hybrid
    cp_layout: str | None = None  # the context-parallel row layout (cp_layout.LAYOUTS)
    bf16: bool = False  # Float16Module around bf16 parameters
    features: tuple = ("F1", "F2")  # the cells this module proves (the others are proven elsewhere)


BF16 = {"bf16": True, "params_dtype": "bfloat16", "pipeline_dtype": "bfloat16"}
LAYOUTS: dict[str, Layout] = {
    "tp2": Layout(world=BY_MARKER["tp2"].world, config={"tensor_model_parallel_size": 2}),
    "sp": Layout(world=BY_MARKER["sp"].world, config={"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "pp2": Layout(world=BY_MARKER["pp2"].world, config={"pipeline_model_parallel_size": 2}, features=("F1",)),
    "vpp2": Layout(world=BY_MARKER["vpp2"].world,
                   config={"num_layers": 4, "pipeline_model_parallel_size": 2,
                           "virtual_pipeline_model_parallel_size": 2, "batch_p2p_comm": False}, features=("F1",)),
    "cp2-zigzag": Layout(world=BY_MARKER["cp2-zigzag"].world, config={"context_parallel_size": 2},
                         cp_layout=BY_MARKER["cp2-zigzag"].cp_layout),
    "cp2-allgather": Layout(world=BY_MARKER["cp2-allgather"].world, config={"context_parallel_size": 2},
                            cp_layout=BY_MARKER["cp2-allgather"].cp_layout),
    "ep2": Layout(world=BY_MARKER["ep2"].world, model="moe"),
    "mtp": Layout(config={"mtp_num_layers": 1, "mtp_loss_scaling_factor": 0.3}, model="mtp"),
    "bf16": Layout(config=BF16, bf16=True),
    "recompute": Layout(config=RECOMPUTE),
    "hybrid": Layout(model="hybrid", features=("F2",)),
}


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def _config(layout: Layout) -> Any:
    import torch

    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config
    from megatron_rl_patches.testing.moe_gpt import tiny_moe_config

    values = {k: getattr(torch, v) if k.endswith("dtype") else v for k, v in layout.config.items()}
    if layout.model == "moe":
        return tiny_moe_config(expert_parallel=layout.world["expert_parallel"], **values)
    return tiny_gpt_config(**values)


def _model(env: Any, layout: Layout, config: Any, seed: int, pre: bool, post: bool, vp_stage: int | None) -> Any:
    from megatron_rl_patches.testing.cp_attention import cp_layer_spec

    stage = dict(pre_process=pre, post_process=post, vp_stage=vp_stage, seed=seed)
    if layout.model == "hybrid":
        return env.with_kind("hybrid").model(config, **stage)
    if layout.model == "moe":
        from megatron_rl_patches.testing.moe_gpt import build_tiny_moe_gpt

        return build_tiny_moe_gpt(config, **stage)
    if layout.model == "mtp":
        import torch
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
        from megatron.core.models.gpt.gpt_model import GPTModel

        spec = get_gpt_layer_local_spec()
        torch.manual_seed(seed)
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=16,
                        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False))
    spec = cp_layer_spec(layout.cp_layout) if layout.cp_layout else None
    model = env.gpt(config, layer_spec=spec, **stage)
    if layout.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    return model


def models(env: Any, layout: Layout, config: Any, seed: int = 0) -> list[Any]:
    """This rank's model chunks (one per virtual stage), the same weights for every mode."""
    from megatron_rl_patches.testing.pipeline import stage_flags

    virtual = layout.world.get("virtual_pipeline")
    return [_model(env, layout, config, seed, *stage_flags(vp), vp) for vp in (range(virtual) if virtual else [None])]


def batch_maker(layout: Layout, rank: int) -> Callable[..., dict]:
    """The microbatch of a seed as this rank holds it: its context-parallel rows; MTP: a loss mask."""
    import torch

    from megatron_rl_patches.testing.cp_layout import split_batch
    from megatron_rl_patches.testing.megatron_cpu import make_batch

    def batch(seed: int) -> dict:
        out = make_batch(seed=seed)
        if layout.model == "mtp":
            out["loss_mask"] = (torch.rand(out["tokens"].shape, generator=torch.Generator().manual_seed(seed))
                                < 0.8).float()
        if layout.cp_layout:
            from megatron.core import parallel_state

            cp_rank = parallel_state.get_context_parallel_rank()
            out = split_batch(out, layout.cp_layout, cp_rank, layout.world["context_parallel"])
        return out

    return batch


# ------------------------------------------------------------------ F1: re-entrant train()


def _rollout_data(batch: Callable[..., dict], dp_rank: int, rollout_id: int) -> list[list[dict]]:
    return [[batch(seed=1000 * dp_rank + 100 * rollout_id + 10 * step + mb) for mb in range(MICROBATCHES)]
            for step in range(ROLLOUT_STEPS)]


def reentry(env: Any, layout: Layout, config_of: Callable[[], Any], batch: Callable[..., dict],
            dp_rank: int) -> dict:
    """3 rollouts through reentrant_train(stand-in train) against the by-hand control; the
    control's second call unpatched first (upstream's assert, nothing changed by it)."""
    from megatron_rl_patches.reentrant import reentrant_train
    from megatron_rl_patches.testing.megatron_cpu import wrap_ddp

    sys.path.insert(0, str(STANDINS))
    import mrp_rollouts
    from slime.backends.megatron_utils import model as slime_model

    slime_model.set_args()

    def chunks() -> list[Any]:
        return [wrap_ddp(m, **mrp_rollouts.OVERLAP) for m in models(env, layout, config_of())]

    def run(train: Callable, model: list[Any], rollout_id: int) -> dict:
        data = _rollout_data(batch, dp_rank, rollout_id)
        return train(rollout_id, model, slime_model.MainGradSGD(0.1), None, data, [len(s) for s in data])

    out: dict = {}
    guarded, patched_model = reentrant_train(slime_model.train), chunks()
    try:
        out["patched"] = [run(guarded, patched_model, r) for r in range(ROLLOUTS)]
    except Exception as exc:  # noqa: BLE001
        out["patched"] = describe(exc)
    model = chunks()
    control = [run(slime_model.train, model, 0)]
    try:
        run(slime_model.train, model, 1)
        out["unpatched"] = "no error"
    except AssertionError as exc:
        out["unpatched"] = describe(exc)
    for rollout_id in range(1, ROLLOUTS):
        mrp_rollouts.rebuild_by_hand(model)
        control.append(run(slime_model.train, model, rollout_id))
    out["control"] = control
    out["params"] = {"patched": _params(patched_model), "control": _params(model)}
    return out


def _params(chunks: list[Any]) -> Any:
    import torch

    return torch.cat([p.detach().float().flatten() for chunk in chunks for p in chunk.module.parameters()])


# ------------------------------------------------------------------ F2: accumulation windows


def windows(env: Any, layout: Layout, config_of: Callable[[], Any], batch: Callable[..., dict],
            dp_rank: int) -> dict:
    import megatron_rl_patches
    from megatron_rl_patches.testing import windows_loop as wl

    optimizer_flags = {"bf16": True} if layout.bf16 else {}

    ref_setup: list = []
    layer_calls: list = [0]

    def run(mode: str, steps: list, optimizer: str | None = "adam") -> Any:
        config = config_of()
        setup = wl.wrap(models(env, layout, config), config, {"overlap_grad_reduce": mode != "ref"}, optimizer,
                        **(optimizer_flags if optimizer else {}))
        setup.batch = batch
        if mode == "ref":
            ref_setup.append(setup)
            count_layer_calls(setup.chunks, layer_calls)
        if mode in ("patch", "dropped"):
            megatron_rl_patches.apply(only="grad_windows", strict=True)
        try:
            cm = (lambda: megatron_rl_patches.accumulation_window(setup.chunks)) if mode == "window" else None
            return wl.run_windows(setup, steps, rank=dp_rank, window_cm=cm)
        except Exception as exc:  # noqa: BLE001 - recorded: the unpatched failure is the point
            return describe(exc)
        finally:
            megatron_rl_patches.revert()

    out = {mode: run(mode, STEPS) for mode in ("ref", "patch", "window")}
    if not isinstance(out["ref"], str):
        out["facts"] = facts(ref_setup[0], layer_calls)
    out["dropped"] = run("dropped", DROPPED)
    out["none"] = run("none", UPSTREAM_FAILS, optimizer=None)
    return out


def _decoder_layers(chunks: list[Any]) -> list[Any]:
    return [module for chunk in chunks for name, module in chunk.named_modules()
            if name.rsplit(".", 3)[-3:-1] == ["decoder", "layers"]]


def count_layer_calls(chunks: list[Any], calls: list[int]) -> None:
    """Count the decoder layers' forward calls (a full recompute runs each twice per microbatch)."""
    def hook(*_: Any) -> None:
        calls[0] += 1

    for layer in _decoder_layers(chunks):
        layer.register_forward_pre_hook(hook)


def facts(setup: Any, layer_calls: list[int]) -> dict:
    """What shows the layout really ran: the parameters' dtypes and shapes, which of them got a
    gradient in the last step, the rows of a microbatch, the layer calls per microbatch."""
    named = [(name, p) for chunk in setup.chunks for name, p in chunk.module.named_parameters()]
    return {
        "dtypes": sorted({str(p.dtype) for _, p in named}),
        "shapes": {name: tuple(p.shape) for name, p in named},
        "with_grad": [name for name, p in named if float(p.main_grad.abs().sum()) > 0],
        "sequence_parallel": sum(bool(getattr(p, "sequence_parallel", False)) for _, p in named),
        "rows": int(setup.batch(seed=0)["tokens"].shape[1]),
        "layer_calls_per_microbatch": layer_calls[0] / sum(len(step) for step in STEPS),
        "layers": len(_decoder_layers(setup.chunks)),
        "optimizers": sorted({type(opt).__name__ for opt in getattr(setup.optimizer, "chained_optimizers",
                                                                      [setup.optimizer])}),
    }


# ------------------------------------------------------------------ the world


def run_layout(name: str, rank: int) -> dict:
    import time

    from megatron.core import parallel_state

    from megatron_rl_patches.testing.megatron_cpu import megatron_world
    from megatron_rl_patches.testing.model_kinds import ModelKindUnavailable

    layout = LAYOUTS[name]
    start = time.perf_counter()
    out: dict = {}
    with megatron_world("cpu", **layout.world) as env:
        try:
            if layout.model == "hybrid":
                env.with_kind("hybrid")
        except ModelKindUnavailable as exc:
            return {"skipped": str(exc)}
        dp_rank = parallel_state.get_data_parallel_rank()
        batch = batch_maker(layout, rank)
        config_of = lambda: _config(layout)  # noqa: E731 - a fresh config per build: train() edits it
        if "F1" in layout.features:
            out["F1"] = reentry(env, layout, config_of, batch, dp_rank)
        if "F2" in layout.features:
            out["F2"] = windows(env, layout, config_of, batch, dp_rank)
    out["seconds"] = time.perf_counter() - start
    return out


def run_all(rank: int, world_size: int, names: tuple = tuple(LAYOUTS)) -> dict:
    from megatron.core import package_info

    return {"version": package_info.__version__, **{name: run_layout(name, rank) for name in names}}
