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
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from megatron_rl_patches import ops
from megatron_rl_patches.ops.kernels import resolve_backend
from megatron_rl_patches.ops.kernels.invariant_tiles import InvariantTiles
from megatron_rl_patches.ops.kernels.native.backend import InvariantNative
from megatron_rl_patches.ops.kernels.native.build import FLAGS, build, cache_dir, compiler, load, native_library
from megatron_rl_patches.settings import NATIVE

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
    cc = compiler()
    assert cc is not None
    serial = load(build(cc, tmp_path, FLAGS))
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


class _Counting:
    """The real kernel, its calls counted (to show an op's sums came from it)."""

    def __init__(self, library) -> None:
        self.library, self.calls = library, 0

    def invariant_row_sums(self, *args) -> None:
        self.calls += 1
        self.library.invariant_row_sums(*args)


def test_the_ops_masked_log_probs_and_gradients_come_from_the_kernel(monkeypatch):
    """Through the op: the kernel's sums (its calls counted) under a keep mask and in backward,
    against float64 (the kept ids' log-softmax; its gradient)."""
    import megatron_rl_patches.ops.kernels as kernels

    counting = _Counting(native_library())
    monkeypatch.setattr(kernels, "native_library", lambda: counting)
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(6, 700, generator=g) * 3).requires_grad_()
    tokens = torch.randint(0, 700, (6,), generator=g)
    keep = torch.rand(6, 700, generator=g) < 0.5
    keep[torch.arange(6), tokens] = True
    masked = ops.log_probs_and_entropy(x.detach(), tokens, keep_mask=keep, invariant=True)[0]
    want = torch.log_softmax(x.detach().double().masked_fill(~keep, -math.inf), 1)[torch.arange(6), tokens]
    torch.testing.assert_close(masked.double(), want, rtol=1e-6, atol=1e-6)
    assert counting.calls > 0
    calls = counting.calls
    log_probs, entropy = ops.log_probs_and_entropy(x, tokens, with_entropy=True, invariant=True)
    (log_probs.sum() + entropy.sum()).backward()
    assert counting.calls > calls
    reference = x.detach().double().requires_grad_()
    logp = torch.log_softmax(reference, 1)
    (logp[torch.arange(6), tokens].sum() - (logp.exp() * logp).sum()).backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad.double(), reference.grad, rtol=1e-5, atol=1e-6)


class _Refusing:
    """A kernel that must not be called."""

    def invariant_row_sums(self, *args) -> None:
        raise AssertionError("the kernel was called")


def _buffers(rows: int, k: int = 0):
    return (torch.zeros(rows, k, dtype=torch.int64), torch.ones(rows, k, dtype=torch.bool),
            torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64))


def test_rows_the_kernel_cannot_read_are_left_to_the_torch_tiles():
    """False, the kernel not called: fp64 rows, rows off the CPU, fp64 shifts."""
    backend = InvariantNative(resolve_backend("torch", CPU), cast(Any, _Refusing()))  # stands for the CDLL
    scale2 = torch.ones(3)
    x = torch.randn(3, 8)
    for rows, shift in ((x.double(), x.amax(1)), (x.to("meta"), x.amax(1).to("meta")), (x, x.amax(1).double())):
        local, inside, rest, moment = _buffers(3)
        assert backend.rest_sums(rows, shift, scale2, local, inside, rest, moment) is False
        assert not rest.any() and not moment.any()


def test_one_column_rows_empty_rows_and_the_inputs_conversions():
    """A one-column row at its own shift sums exactly 2^0 (2^44 units) and no moment, whatever its
    stride; nothing to sum is done (True); the scale and marks in any dtype, no moment asked."""
    library = native_library()
    assert library is not None
    backend = InvariantNative(resolve_backend("torch", CPU), library)
    column = torch.randn(4, 3).t()[:, :1]  # [3, 1], column stride 3
    assert column.stride(1) != 1
    local, inside, rest, moment = _buffers(3)
    assert backend.rest_sums(column, column[:, 0].clone(), torch.ones(3), local, inside, rest, moment)
    assert rest.tolist() == [2 ** 44] * 3 and moment.tolist() == [0] * 3
    for empty in (torch.zeros(0, 5), torch.zeros(3, 0)):
        local, inside, rest, moment = _buffers(empty.size(0))
        assert backend.rest_sums(empty, torch.zeros(empty.size(0)), torch.ones(empty.size(0)), local, inside,
                                 rest, moment) is True
        assert not rest.any()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 300, generator=g) * 4
    shift = x.amax(1)
    marks = torch.tensor([[1, 7], [0, 299], [5, 6]])
    rest, moment = _sums(x, shift, marks)
    got = torch.zeros(3, dtype=torch.int64)  # a float64 scale, int32 columns, int64 flags; moment not wanted
    assert backend.rest_sums(x, shift, torch.tensor(1 / math.log(2), dtype=torch.float64), marks.int(),
                             torch.ones(3, 2, dtype=torch.int64), got, None)
    assert torch.equal(got, rest)
    strided = torch.zeros(3, 2, dtype=torch.int64)[:, 0]
    with pytest.raises(AssertionError):  # the kernel writes whole int64 rows in place: no strided buffer
        backend.rest_sums(x, shift, torch.ones(3), marks, torch.ones(3, 2, dtype=torch.bool), strided, None)


def _on_path(monkeypatch, tmp_path, names) -> Path:
    """PATH = one folder holding the system compiler under each of `names`; no $CC."""
    real = compiler()
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in names:
        (folder / name).symlink_to(real)
    monkeypatch.setenv("PATH", str(folder))
    monkeypatch.delenv("CC", raising=False)
    return folder


@pytest.mark.parametrize("names", [("cc",), ("gcc",), ("cc", "gcc")])
def test_the_compiler_is_cc_else_gcc_on_path_or_cc_by_name(monkeypatch, tmp_path, names):
    folder = _on_path(monkeypatch, tmp_path, names)
    assert compiler() == str(folder / names[0])
    monkeypatch.setenv("CC", names[-1])
    assert compiler() == str(folder / names[-1])


def test_the_cache_is_under_xdg_cache_home_else_the_homes_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "megatron_rl_patches" / "native"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "megatron_rl_patches" / "native"


def _script(folder: Path, name: str, body: str) -> str:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_a_build_is_kept_per_compiler_and_a_failed_one_raises_quietly(monkeypatch, tmp_path, capfd):
    """Another compiler (its --version, even failing) is another library; the same one is reused
    without compiling; missing parent folders are made and the temporary files stay inside the
    cache (no system temporary folder needed); a compiler's failure is its CalledProcessError,
    its output kept off the terminal and nothing left behind."""
    import tempfile

    real = compiler()
    other = _script(tmp_path, "other-cc", f'[ "$1" = --version ] && {{ echo other 9; exit 3; }}\nexec {real} "$@"')
    counting = _script(tmp_path, "counting-cc", f'[ "$1" = --version ] || echo x >> {tmp_path}/compiled\n'
                       f'exec {real} "$@"')
    directory = tmp_path / "a" / "b"
    with monkeypatch.context() as patched:
        patched.setattr(tempfile, "tempdir", str(tmp_path / "no-such-tmp"))
        built = build(counting, directory, FLAGS)
        assert build(counting, directory, FLAGS) == built and (tmp_path / "compiled").read_text() == "x\n"
        assert build(other, directory, FLAGS) != built
    assert all(p.is_file() and ".so" in p.name for p in directory.iterdir())  # libraries and their records only
    failing = _script(tmp_path, "failing-cc", '[ "$1" = --version ] && exit 0\necho broken >&2; exit 1')
    capfd.readouterr()
    with pytest.raises(subprocess.CalledProcessError):
        build(failing, tmp_path / "c", FLAGS)
    assert capfd.readouterr() == ("", "")
    assert list((tmp_path / "c").iterdir()) == []
