"""The invariant mode's compiled CPU sums (ops/kernels/native): built here at first use (the lanes
have a C compiler), each row's integers independent of where its elements sit (vector lanes, the
loop remainder, the marked columns), values within 1e-6 of the torch tiles' and float64's; off by
the setting or without a compiler (the torch tiles); a rank with it beside one without is the same
error on every rank (in the TP = 2 invariance world, invariance_worlds.py)."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest
import torch

from megatron_rl_patches import ops
from megatron_rl_patches._variables import NATIVE
from megatron_rl_patches.ops.kernels import resolve_backend
from megatron_rl_patches.ops.kernels.invariant_tiles import InvariantTiles
from megatron_rl_patches.ops.kernels.native.backend import InvariantNative
from megatron_rl_patches.ops.kernels.native.build import FLAGS, build, compiler, load, native_library

CPU = torch.device("cpu")


def _route() -> type:
    return type(resolve_backend(None, CPU, invariant=True))


def test_the_cpu_route_is_the_compiled_kernel_unless_turned_off_or_no_compiler(monkeypatch):
    assert native_library() is not None and _route() is InvariantNative
    assert type(resolve_backend(None, CPU, invariant=False)) is not InvariantNative  # the default mode
    monkeypatch.setenv(NATIVE, "0")
    assert native_library() is None and _route() is InvariantTiles
    monkeypatch.setenv(NATIVE, "1")
    monkeypatch.setenv("CC", "/nonexistent/cc")  # no compiler: the torch tiles, no error
    assert native_library() is None and _route() is InvariantTiles


def test_a_setting_that_is_not_a_switch_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(NATIVE, "maybe")
    with pytest.raises(ValueError, match=rf"{NATIVE}='maybe' is not a switch"):
        ops.log_probs_and_entropy(torch.zeros(1, 4), torch.tensor([0]), invariant=True)


def _sums(x: torch.Tensor, shift: torch.Tensor, k_cols=None, library=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's (rest, moment) integers of rows x at `shift`, columns `k_cols` [r, k] marked."""
    library = library or native_library()
    assert library is not None
    rows = x.size(0)
    local = torch.zeros(rows, 0, dtype=torch.int64) if k_cols is None else k_cols
    rest, moment = torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64)
    backend = InvariantNative(resolve_backend("torch", CPU), library)
    inside = torch.ones_like(local, dtype=torch.bool)
    assert backend.rest_sums(x, shift, torch.full((rows,), 1 / math.log(2)), local, inside, rest, moment)
    return rest, moment


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_integers_do_not_depend_on_where_its_elements_sit(dtype):
    g = torch.Generator().manual_seed(0)
    values = (torch.randn(3, 1000, generator=g) * 4).to(dtype)
    shift = values.float().amax(1)
    rest, moment = _sums(values, shift)
    for offset in (1, 3, 7, 8, 15, 16, 17, 31, 33, 64):  # every vector lane and the scalar remainder
        padded = torch.full((3, 1000 + offset + offset % 5), -math.inf).to(dtype)
        padded[:, offset: offset + 1000] = values  # -inf columns add 0
        assert all(torch.equal(a, b) for a, b in zip(_sums(padded, shift), (rest, moment))), offset
    for threads in (2, 3):  # rows over threads: each row one thread's whole
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            wide = torch.cat([values] * 400)  # enough work for every thread
            assert all(torch.equal(a, b.repeat(400)) for a, b in zip(_sums(wide, shift.repeat(400)), (rest, moment)))
        finally:
            torch.set_num_threads(saved)
    # a marked column left out gives the integers of the row without it (its terms subtracted)
    marks = torch.tensor([[5, 5], [0, 999], [400, 401]])
    kept = torch.ones(3, 1000, dtype=torch.bool).scatter_(1, marks, False)
    without = [_sums(values[r, kept[r]][None], shift[r: r + 1]) for r in range(3)]
    marked = _sums(values, shift, marks)
    for r in range(3):
        assert int(marked[0][r]) == int(without[r][0][0]) and int(marked[1][r]) == int(without[r][1][0])
    # negative control: the integers see the row's second largest element move by one step
    nudged = values.clone()
    second = int(values[0].float().topk(2).indices[1])
    step = torch.nextafter(values[0, second].float(), torch.tensor(math.inf))
    nudged[0, second] = step if dtype == torch.float32 else values[0, second] + 0.0625
    assert int(_sums(nudged, shift)[0][0]) != int(rest[0])


def test_values_within_1e6_of_the_torch_tiles_and_of_float64(monkeypatch):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3001, generator=g) * 5
    tokens = torch.randint(0, 3001, (5,), generator=g)
    native = ops.log_probs_and_entropy(x, tokens, with_entropy=True, invariant=True)
    monkeypatch.setenv(NATIVE, "0")
    tiles = ops.log_probs_and_entropy(x, tokens, with_entropy=True, invariant=True)
    reference = torch.log_softmax(x.double(), 1)
    entropy = -(reference.exp() * reference).sum(1)
    for got in (native, tiles):
        torch.testing.assert_close(got[0].double(), reference.gather(1, tokens[:, None])[:, 0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got[1].double(), entropy, rtol=1e-6, atol=1e-6)


def test_the_serial_build_gives_the_threaded_builds_integers(tmp_path):
    """A compiler without OpenMP builds the kernel serial: the same integers as the threaded one
    running on 3 threads."""
    serial = load(build(compiler(), tmp_path, FLAGS))
    values = torch.randn(600, 1000, generator=torch.Generator().manual_seed(3)) * 4
    shift = values.amax(1)
    saved = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        threaded_sums, serial_sums = _sums(values, shift), _sums(values, shift, library=serial)
    finally:
        torch.set_num_threads(saved)
    assert all(torch.equal(a, b) for a, b in zip(threaded_sums, serial_sums))


def test_a_fresh_build_takes_seconds(tmp_path):
    """The compile time make test pays once per machine (cached after): a fresh cache, one build."""
    script = ("from megatron_rl_patches.ops.kernels.native.build import FLAGS, build, compiler, load, native_library; "
              "assert native_library() is not None")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", script], check=True, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    assert time.perf_counter() - start < 60
    assert len(list((tmp_path / "megatron_rl_patches" / "native").glob("*.so"))) == 1


def native_checks(rank: int, world: int) -> dict:
    """At TP = world: the op with the compiled sums on every rank (its values), and with rank 1's
    setting off (the error text, or "ran")."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2 * 100, generator=g)[:, rank * 100: (rank + 1) * 100]
    tokens = torch.tensor([0, 150, 99])

    def call():
        return ops.log_probs_and_entropy(x, tokens, invariant=True, tp_group=dist.group.WORLD)[0]

    out = {"both": call()}
    saved = os.environ.get(NATIVE)
    if rank == 1:
        os.environ[NATIVE] = "0"
    try:
        out["mixed"] = f"ran {call()}"
    except ValueError as exc:
        out["mixed"] = str(exc)
    finally:
        if saved is None:
            os.environ.pop(NATIVE, None)
        else:
            os.environ[NATIVE] = saved
    return out


@pytest.mark.multirank
def test_at_tp2_a_rank_without_the_kernel_is_the_same_error_on_every_rank(invariance_world):
    ranks = invariance_world.results(2, "native")
    assert torch.equal(ranks[0]["both"], ranks[1]["both"])
    for results in ranks:
        assert "differs between the ranks" in results["mixed"], results["mixed"]
        assert "InvariantNative" in results["mixed"] and "InvariantTiles" in results["mixed"]
        assert f"{NATIVE}=0" in results["mixed"]
