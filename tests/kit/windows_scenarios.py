"""Every accumulation-window scenario of one lane, run on each of 2 gloo ranks in ONE spawn
(`run_all`); test_windows.py asserts on the cached results. Modes: `ref` (overlap_grad_reduce=False,
the synchronous reference), `none` (overlap, no fix: upstream), `patch` (apply("grad_windows")),
`window` (accumulation_window around each window, no apply()). A mode that raises records
"ExceptionType: message" in place of its result."""
from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

MODES = ("ref", "none", "patch", "window")
ONE_MB = {"2,1": [[1, 1], [1]], "2,3": [[1, 1], [1, 1, 1]], "1,2": [[1], [1, 1]], "mb2,1": [[2], [1]],
          "2,2": [[1, 1], [1, 1]]}
STEPS = [[1], [1, 1], [1, 1, 1]]  # optimizer runs: 3 steps of changing shape
# name -> (windows, ddp flags, optimizer, windows whose forward skips the embedding)
DP_CASES: dict[str, tuple[list, dict, str | None, tuple[int, ...]]] = {
    **{name: (windows, {}, None, ()) for name, windows in ONE_MB.items()},
    "mb-change": ([[2, 1], [1, 3], [3]], {}, None, ()),
    "unused-param": ([[1, 1], [1, 1]], {}, None, (1,)),
    "sgd": (STEPS, {}, "sgd", ()),
    "adam": (STEPS, {}, "adam", ()),
    "distopt-adam": (STEPS, {"use_distributed_optimizer": True}, "adam", ()),
    "param-gather-adam": (STEPS, {"use_distributed_optimizer": True, "overlap_param_gather": True}, "adam", ()),
}
PP_CASES = {"2,1": [[2, 2], [2]], "2,3": [[2, 2], [2, 2, 2]]}
# Issue 29: finishes inside a window, then a next window; force_all_reduce (from 0.16) on the
# distributed optimizer, the whole buffer compared. name -> (windows, ddp flags, finalize kwargs)
_IN, _TWICE = [1, "finalize", 1], [1, "finish", "finish", 1]
_DISTOPT, _FORCE = {"use_distributed_optimizer": True}, {"force_all_reduce": True}
FINISH_CASES: dict[str, tuple[list, dict, dict]] = {
    "finalize-inside": ([_IN, [1, 1]], {}, {}),
    "finish-twice": ([_TWICE, [1, 1]], {}, {}),
    "finalize-last": ([[1, 1, "finalize"], [1]], {}, {}),
    "distopt-finish-twice": ([_TWICE, [1]], _DISTOPT, {}),
    "force": ([[1], [1]], _DISTOPT, _FORCE),
    "force-split": ([[1, 1], [1, 1, 1]], _DISTOPT, _FORCE),
    "force-finalize-inside": ([_IN, [1, 1]], _DISTOPT, _FORCE),
    "force-finalize-last": ([[1, "finalize"], [1]], _DISTOPT, _FORCE),
}
FORCE_FROM = (0, 16)  # finalize_model_grads(force_all_reduce=) exists from megatron-core 0.16
# A finish right after a finish is outside grad_windows' windows (each ends at its finish):
# upstream's overlap handles it (0.13 asserts), so these run in accumulation_window only.
WINDOW_ONLY = {"finish-twice", "distopt-finish-twice", "finalize-last", "force-finalize-last"}
STANDINS = Path(__file__).resolve().parents[1] / "standins"


def assert_equal(result: Any, reference: Any, what: str) -> None:
    """A run_windows result equals the reference bit for bit (grads per window, parameters), and
    no reduce was left in flight after any window's finalize."""
    assert not isinstance(result, str), f"{what}: {result}"
    assert not isinstance(reference, str), f"{what}: the reference failed: {reference}"
    assert len(result["grads"]) == len(reference["grads"]), what
    for w, (got, want) in enumerate(zip(result["grads"], reference["grads"])):
        assert torch.equal(got, want), f"{what}, window {w}: max |Δ| {(got - want).abs().max():.3g}"
    assert torch.equal(result["params"], reference["params"]), f"{what}: parameters differ"
    assert not any(result["in_flight"]), f"{what}: a reduce still in flight after finalize: {result['in_flight']}"


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def _run_mode(env: Any, mode: str, run: Callable[[Any], dict], build: Callable[[dict], Any]) -> Any:
    import megatron_rl_patches

    setup = build({"overlap_grad_reduce": mode != "ref"})
    if mode == "patch":
        megatron_rl_patches.apply(only="grad_windows", strict=True)
    try:
        cm = (lambda: megatron_rl_patches.accumulation_window(setup.chunks)) if mode == "window" else None
        return run(setup, cm)
    except Exception as exc:  # noqa: BLE001 - recorded: the unpatched failures are the point
        return _describe(exc)
    finally:
        megatron_rl_patches.revert()


# Before 0.16 an unpatched pipelined window asserts "Cannot set grad twice" in one stage's backward
# while the other stage waits for it in a point-to-point receive: a hang, so it is not run.
PP_HANG = "hang: one stage asserts 'Cannot set grad twice' in backward, the other waits in a p2p receive"


def _cases(env: Any, rank: int, cases: dict, virtual: int | None = None, skip_none: str = "",
           run_kwargs: dict | None = None, modes: Callable[[str], tuple] = lambda name: MODES) -> dict:
    """`modes(name)` of every case; `run_kwargs[name]` go to that case's run_windows."""
    from megatron_rl_patches.testing import windows_loop as wl

    out = {}
    for name, case in cases.items():
        windows, flags, optimizer, skip = case if isinstance(case, tuple) else (case, {}, None, ())
        build = lambda mode_flags, flags=flags, optimizer=optimizer: wl.build(  # noqa: E731
            env, {**flags, **mode_flags}, optimizer, virtual=virtual)
        case_kwargs = (run_kwargs or {}).get(name, {})

        def run(setup: Any, cm: Any, windows: list = windows, skip: tuple = skip, extra: dict = case_kwargs) -> dict:
            return wl.run_windows(setup, windows, rank=rank, window_cm=cm, skip_embedding_in=skip, **extra)

        out[name] = {mode: skip_none if mode == "none" and skip_none else _run_mode(env, mode, run, build)
                     for mode in modes(name)}
    return out


def run_finishes(rank: int, world_size: int) -> dict:
    """FINISH_CASES on this rank (DP = world size); the force_all_reduce cases only where they
    can change something (listed under "skipped" with the reason otherwise)."""
    from megatron.core import package_info

    from megatron_rl_patches.testing.megatron_cpu import megatron_world

    version = (int(package_info.MAJOR), int(package_info.MINOR))
    skipped = {}
    for name, (_, _, kwargs) in FINISH_CASES.items():
        if kwargs and version < FORCE_FROM:
            skipped[name] = "finalize_model_grads has no force_all_reduce before megatron-core 0.16"
        elif kwargs and world_size == 1:
            skipped[name] = "one rank: a reduce-scatter is an all-reduce"
    cases = {name: case for name, case in FINISH_CASES.items() if name not in skipped}
    dp_cases = {name: (windows, flags, None, ()) for name, (windows, flags, _) in cases.items()}
    run_kwargs = {name: {"finalize_kwargs": kwargs, "whole_buffer": bool(kwargs)}
                  for name, (_, _, kwargs) in cases.items()}

    def modes(name: str) -> tuple:  # unpatched overlap only where the test compares it
        return ("ref", "window") if name in WINDOW_ONLY else ("ref", "none", "patch", "window") if name == "force" \
            else ("ref", "patch", "window")

    with megatron_world("cpu") as env:
        return {"version": package_info.__version__, "skipped": skipped,
                "cases": _cases(env, rank, dp_cases, run_kwargs=run_kwargs, modes=modes)}


# ------------------------------------------------------------------ dispatch point and cost


@contextlib.contextmanager
def _dispatch_recorder(setup: Any, records: list) -> Any:
    """Record every bucket-group reduce start: microbatches run so far, and whether it came from a
    backward hook (register_grad_ready on the stack) or from finish_grad_sync."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup as Group

    original = Group.start_grad_sync

    def recording(self: Any, *args: Any, **kwargs: Any) -> Any:
        names = [frame.function for frame in inspect.stack()[1:12]]
        where = "backward" if "register_grad_ready" in names else "finish" if "_finish" in names or \
            "finish_grad_sync" in names else "other"
        if self.grad_reduce_handle is None:
            records.append((setup.forward_steps[0], where))
        return original(self, *args, **kwargs)

    Group.start_grad_sync = recording
    try:
        yield
    finally:
        Group.start_grad_sync = original


def _dispatch(env: Any, rank: int) -> dict:
    """Megatron-LM's train_step shape (finalize_model_grads_func set, one call of 2 microbatches
    per step) with and without the patch, then split windows with the patch."""
    import megatron_rl_patches
    from megatron_rl_patches.testing import windows_loop as wl

    out = {}
    for mode, windows, in_call in (("none", [[2]] * 3, True), ("patch", [[2]] * 3, True),
                                   ("patch-split", [[1, 1]] * 2, False)):
        setup = wl.build(env, {"overlap_grad_reduce": True})
        records: list = []
        if mode.startswith("patch"):
            megatron_rl_patches.apply(only="grad_windows", strict=True)
        try:
            with _dispatch_recorder(setup, records):
                wl.run_windows(setup, windows, rank=rank, finalize_in_call=in_call)
        finally:
            megatron_rl_patches.revert()
        out[mode] = records
    return out


@contextlib.contextmanager
def _counting(counts: dict) -> Any:
    """Count collectives (torch.distributed and the reduce-scatter megatron-core bound at import)
    and host syncs (Tensor.item / tolist, torch.cuda.synchronize) made inside the block."""
    import megatron.core.distributed.param_and_grad_buffer as pgb

    targets = [(torch.distributed, name) for name in ("all_reduce", "reduce_scatter_tensor", "_reduce_scatter_base",
                                                      "all_gather_into_tensor", "_all_gather_base", "all_gather",
                                                      "broadcast", "barrier", "reduce_scatter")]
    targets += [(pgb, "dist_reduce_scatter_func"), (torch.Tensor, "item"), (torch.Tensor, "tolist"),
                (torch.cuda, "synchronize")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in targets if hasattr(owner, name)]

    def counter(key: str, fn: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[key] = counts.get(key, 0) + 1
            return fn(*args, **kwargs)
        return call

    for owner, name, fn in saved:
        setattr(owner, name, counter(name, fn))
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def _cost(env: Any, rank: int) -> dict:
    """Collectives and host syncs of 3 steady windows of 2 calls, per mode."""
    from megatron_rl_patches.testing import windows_loop as wl

    out = {}
    for mode in MODES:
        counts: dict = {}

        def run(setup: Any, cm: Any, counts: dict = counts) -> dict:
            with _counting(counts):
                return wl.run_windows(setup, [[1, 1]] * 3, rank=rank, window_cm=cm)

        result = _run_mode(env, mode, run, lambda flags: wl.build(env, flags))
        out[mode] = counts if not isinstance(result, str) else result
    return out


# ------------------------------------------------------------------ accumulation_window semantics


def _state(chunk: Any) -> dict:
    from megatron_rl_patches import windows

    groups = windows.bucket_groups(chunk)
    return {
        "in_flight": any(g.grad_reduce_handle is not None for g in groups),
        "shadowed": any(name in vars(g) for g in groups for name in ("register_grad_ready", "start_grad_sync"))
        or "finish_grad_sync" in vars(chunk),
        "counts": sum(len(getattr(g, "per_param_grad_ready_counts", None) or getattr(g, "params_with_grad", ()))
                      for g in groups),
    }


def _semantics(env: Any, rank: int) -> dict:
    """Nesting, an exception inside, a window with no backward, a window opened while a reduce is
    in flight; each followed by windows compared with the reference."""
    from megatron.core.distributed import finalize_model_grads

    from megatron_rl_patches import accumulation_window
    from megatron_rl_patches.testing import windows_loop as wl
    from megatron_rl_patches.testing.megatron_cpu import make_batch

    def call(setup: Any, w: int, c: int, forward_only: bool = False) -> None:
        batches = [make_batch(seed=wl.batch_seed(rank, w, c, 0))]
        if forward_only:
            from megatron.core.pipeline_parallel import get_forward_backward_func

            get_forward_backward_func()(forward_step_func=wl.forward_step(setup), data_iterator=iter(batches),
                                        model=setup.chunks, num_microbatches=1,
                                        seq_length=batches[0]["tokens"].shape[1],
                                        micro_batch_size=1, forward_only=True)
        else:
            wl.schedule_call(setup, batches, wl.forward_step(setup))

    out: dict = {"ref": wl.run_windows(wl.build(env, {}), [[1, 1, 1]], rank=rank)}
    out["ref2"] = wl.run_windows(wl.build(env, {}), [[1, 1], [1]], rank=rank)
    window = lambda setup: accumulation_window(setup.chunks)  # noqa: E731

    setup = wl.build(env, {"overlap_grad_reduce": True})  # nesting: only the outermost exit reduces
    chunk = setup.chunks[0]
    setup.chunks[0].zero_grad_buffer()
    with window(setup):
        call(setup, 0, 0)
        with window(setup):
            call(setup, 0, 1)
        out["after_inner_exit"] = _state(chunk)
        call(setup, 0, 2)
        try:  # a finish that does not fit upstream's signature: upstream's TypeError, nothing started
            chunk.finish_grad_sync(not_an_argument=True)
            out["bad_finish"] = "no error"
        except TypeError as exc:
            out["bad_finish"] = _describe(exc)
        out["after_bad_finish"] = _state(chunk)
    out["after_outer_exit"] = _state(chunk)
    with window(setup):  # the left window still defers to the next finish: a new block joins it
        pass
    out["after_rejoin"] = _state(chunk)
    finalize_model_grads(setup.chunks)
    out["nested"] = wl.own_grad(chunk)
    out["after_finalize"] = _state(chunk)
    chunk.zero_grad_buffer()
    chunk.start_grad_sync()  # upstream's own reduce, in flight
    try:  # a window cannot open while a reduce is in flight
        with window(setup):
            pass
        out["open_in_flight"] = "no error"
    except Exception as exc:  # noqa: BLE001
        out["open_in_flight"] = _describe(exc)
    chunk.finish_grad_sync()

    setup = wl.build(env, {"overlap_grad_reduce": True})  # an exception inside, then two windows
    setup.chunks[0].zero_grad_buffer()
    try:
        with window(setup):
            call(setup, 9, 0)
            call(setup, 9, 1)
            raise KeyError("injected")
    except KeyError:
        pass
    out["after_exception"] = _state(setup.chunks[0])
    out["exception_then"] = wl.run_windows(setup, [[1, 1], [1]], rank=rank, window_cm=lambda: window(setup))

    setup = wl.build(env, {"overlap_grad_reduce": True})  # a window with no backward, then one with
    setup.chunks[0].zero_grad_buffer()
    with window(setup):
        call(setup, 0, 0, forward_only=True)
    out["after_no_backward"] = _state(setup.chunks[0])
    out["no_backward_then"] = wl.run_windows(setup, [[1, 1], [1]], rank=rank, window_cm=lambda: window(setup))
    return out


# ------------------------------------------------------------------ re-entrant train()


def _reentry(env: Any, rank: int) -> dict:
    """The stand-in slime train() through reentrant_train, 3 rollouts whose microbatch counts change,
    overlap flags on (patches ddp_hooks + grad_windows), against overlap_grad_reduce=False (same
    param-gather flags: the stand-in's SGD updates whole buffers, the forward pre-hooks' all-gather
    overwrites the other rank's shard)."""
    import megatron_rl_patches
    from megatron_rl_patches.reentrant import reentrant_train

    sys.path.insert(0, str(STANDINS))
    from slime.backends.megatron_utils import model as slime_model

    counts = [[2, 2], [3, 1], [1, 3]]

    def rollouts(overlap: bool) -> list:
        slime_model.set_args(overlap_grad_reduce=overlap)
        chunks = [env.ddp(env.gpt(env.config(), seed=0), overlap_grad_reduce=overlap, use_distributed_optimizer=True,
                          overlap_param_gather=True)]
        train = reentrant_train(slime_model.train)
        results = []
        for rollout_id, per_step in enumerate(counts):
            data = [[env.batch(seed=1000 * rank + 100 * rollout_id + 10 * step + mb) for mb in range(n)]
                    for step, n in enumerate(per_step)]
            results.append(train(rollout_id, chunks, slime_model.MainGradSGD(0.1), None, data, per_step))
        return results

    megatron_rl_patches.apply(only=["ddp_hooks", "grad_windows"], strict=True)
    try:
        patched = rollouts(True)
    except Exception as exc:  # noqa: BLE001
        patched = _describe(exc)
    finally:
        megatron_rl_patches.revert()
    return {"patched": patched, "ref": rollouts(False)}


def run_all(rank: int, world_size: int) -> dict:
    """Every scenario of this lane on this rank (DP = 2, then PP = 2 plain and interleaved)."""
    from megatron.core import package_info

    from megatron_rl_patches.testing.megatron_cpu import megatron_world, tiny_gpt_config

    out: dict = {"version": package_info.__version__}
    old = (int(package_info.MAJOR), int(package_info.MINOR)) < (0, 16)
    with megatron_world("cpu") as env:
        out["dp"] = _cases(env, rank, DP_CASES)
        out["dispatch"] = _dispatch(env, rank)
        out["cost"] = _cost(env, rank)
        out["semantics"] = _semantics(env, rank)
        out["reentry"] = _reentry(env, rank)
    for label, virtual in (("pp", None), ("vpp", 2)):
        with megatron_world("cpu", pipeline_parallel=2, virtual_pipeline=virtual) as env:
            # unbatched p2p with virtual stages, as Megatron-LM runs them (megatron_cpu.check_interleaved_p2p)
            extra = {"virtual_pipeline_model_parallel_size": virtual, "batch_p2p_comm": False} if virtual else {}
            env.config = lambda extra=extra, **kw: tiny_gpt_config(num_layers=4, pipeline_model_parallel_size=2,
                                                                   **extra)
            out[label] = _cases(env, rank, PP_CASES, virtual=virtual, skip_none=PP_HANG if old else "")
    return out
