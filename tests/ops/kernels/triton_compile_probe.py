"""Compile the Triton kernels ahead of time for NVIDIA targets, no GPU needed (triton's own
ptxas): proof that the GPU compiler, not only the interpreter, accepts them. Run as a script
without TRITON_INTERPRET: ``python triton_compile_probe.py ARCH...`` prints one line per variant."""
from __future__ import annotations

import concurrent.futures as futures
import itertools
import multiprocessing
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megatron_rl_patches.ops._divergences import DIVERGENCES
from megatron_rl_patches.ops.kernels.triton import launch
from megatron_rl_patches.ops.kernels.triton._divergence import divergence_tile_kernel
from megatron_rl_patches.ops.kernels.triton._fold import row_stats_kernel
from megatron_rl_patches.ops.kernels.triton._grad import grad_tile_kernel
from megatron_rl_patches.ops.kernels.triton._invariant import invariant_tile_kernel
from megatron_rl_patches.ops.kernels.triton._topk import topk_tile_kernel

INTS = {"n_rows", "n_valid", "cols_per_split", "row_begin", "row_end", "col_begin", "col_end",
        "first_id", "sentinel"}
# the hidden size is a constexpr of the kernels (a loop bound every triton's interpreter takes)
HIDDEN = 4096
FLOATS = {"scale_value", "w", "log_w", "log_1mw", "to_fixed"}


def _signature(fn, pointers: dict[str, str], consts: dict) -> dict[str, str]:
    def kind(name: str) -> str:
        if name in consts:
            return "constexpr"
        if name in pointers:
            return pointers[name]
        if name in INTS or name.startswith("s_"):
            return "i32"
        return "fp32" if name in FLOATS else "*fp32"

    return {name: kind(name) for name in fn.arg_names}


def compile_variant(fn, arch: int, dtype: str, fused: bool, flags: dict, k: int | None) -> str:
    import torch

    b = launch.blocks(torch.device("cuda"), fused)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    consts = {**flags, **({} if k is None else {"K": k, "FUSED": fused}), **b.launch(torch_dtype)}
    hidden_names = ("n_hidden_s", "n_hidden_t") if fn is divergence_tile_kernel else ("n_hidden",)
    consts.update(dict.fromkeys(hidden_names, HIDDEN if fused else 0))
    options = {"num_warps": consts.pop("num_warps"), "num_stages": consts.pop("num_stages")}
    consts["DOT_FP32"] = False  # the GPU path, whatever this process's interpreter setting
    pointers = {"src": f"*{dtype}", "weight": f"*{dtype}", "keep": "*i8", "marks": "*i32", "out": f"*{dtype}",
                "out_ids": "*i64", **{name: f"*{dtype}" for name in ("h_s", "w_s", "h_t", "w_t")},
                **dict.fromkeys(("out_rest", "out_moment", "out_sub_sum"), "*i64")}  # the invariant int64 sums
    if fn is divergence_tile_kernel and not flags["GRAD"]:
        pointers["out"] = "*fp32"  # pass 2's row sums
    source = ASTSource(fn=fn, signature=_signature(fn, pointers, consts),
                       constexprs={(fn.arg_names.index(name),): value for name, value in consts.items()})
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    assert kernel.asm.get("cubin"), "no cubin"
    return f"sm_{arch} {fn.__name__} {dtype} fused={fused} k={k} flags={flags}: ok"


FOLD_FLAGS = ("ROW_SCALE", "HAS_REST", "HAS_MOMENT", "HAS_SUB", "HAS_KEEP")
GRAD_FLAGS = ("ROW_SCALE", "HAS_ALPHA", "HAS_BETA", "HAS_SUB", "HAS_GAMMA", "HAS_KEEP", "HAS_MARK_ALPHA", "HAS_ETA",
              "HAS_DELTA")


def variants(arches: list[int]) -> list[tuple]:
    """Every variant to compile: (kernel, arch, dtype, fused, flags, k), in the order printed."""
    todo: list[tuple] = []
    for arch, dtype, fused, on in itertools.product(arches, ("bf16", "fp32"), (True, False), (True, False)):
        k = 4 if on else 1
        todo.append((row_stats_kernel, arch, dtype, fused, dict.fromkeys(FOLD_FLAGS, on), k))
        todo.append((grad_tile_kernel, arch, dtype, fused, dict.fromkeys(GRAD_FLAGS, on), k))
    # the invariant mode's two passes, every flag on: bf16 fused, fp32 logits (the tile's two ways
    # in are the fold kernel's, compiled above in all four)
    for arch, (dtype, fused), sums in itertools.product(arches, (("bf16", True), ("fp32", False)), (False, True)):
        flags = {**dict.fromkeys(FOLD_FLAGS, True), "SUMS": sums}
        todo.append((invariant_tile_kernel, arch, dtype, fused, flags, 4))
    for arch, dtype in itertools.product(arches, ("bf16", "fp32")):  # lm_head_divergence's normalizers
        flags = {**dict.fromkeys(FOLD_FLAGS, False), "HAS_REST": True}
        todo.append((row_stats_kernel, arch, dtype, True, flags, 0))
    for arch, dtype, fused in itertools.product(arches, ("bf16", "fp32"), (True, False)):  # the top-k ids
        todo.append((topk_tile_kernel, arch, dtype, fused, {}, 8))
    # lm_head_divergence's pass 2 and backward: both modes with every flag on in each dtype, and
    # every table row once
    jsd = DIVERGENCES.index("jsd")
    for arch, dtype, grad in itertools.product(arches, ("bf16", "fp32"), (False, True)):
        flags = {"DIV": jsd, "GRAD": grad, "HAS_CONSTANT": grad, "ROW_SCALE": True, "HAS_KEEP": True}
        todo.append((divergence_tile_kernel, arch, dtype, True, flags, None))
    for arch, div in itertools.product(arches, range(len(DIVERGENCES))):
        flags = {"DIV": div, "GRAD": True, "HAS_CONSTANT": False, "ROW_SCALE": False, "HAS_KEEP": False}
        todo.append((divergence_tile_kernel, arch, "fp32", True, flags, None))
    return todo


def compile_nth(index: int, arches: list[int]) -> str:
    """The `index`-th variant compiled (in a worker process: it builds the same list)."""
    return compile_variant(*variants(arches)[index])


def main(arches: list[int]) -> None:
    """Every variant compiled, one worker process per core (compiling is CPU-bound and each
    variant is independent), the lines printed in the variants' order."""
    count = len(variants(arches))
    workers = max(1, min(count, len(os.sched_getaffinity(0))))
    with futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        for line in pool.map(compile_nth, range(count), itertools.repeat(arches)):
            print(line, flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [80, 90])
