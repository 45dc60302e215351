"""A damaged cache of the compiled invariant CPU kernel (ops/kernels/native): a library cut short, or
another library under the kernel's file name, is never loaded (before: SIGBUS, exit -7, or a bare
AttributeError): it is rebuilt with one warning naming it, and the op gives the intact cache's
values; a cache that cannot be written gets the kernel built for the process alone, with one
warning. Run in one fresh process over several caches (XDG_CACHE_HOME switched between them)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl_patches.ops.kernels.native.build import build, compiler, load
from megatron_rl_patches.ops.kernels.native.record import mismatch, record_path, write_record

# each cache in argv in turn: the op's values, the CPU route and the warnings it gave
SCRIPT = r"""
import json, os, sys, warnings
import torch
from megatron_rl_patches import ops
from megatron_rl_patches.ops.kernels import resolve_backend

g = torch.Generator().manual_seed(0)
x, tokens = torch.randn(4, 300, generator=g) * 3, torch.randint(0, 300, (4,), generator=g)
out = {}
for cache in sys.argv[1:]:
    os.environ["XDG_CACHE_HOME"] = cache
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        values = ops.log_probs_and_entropy(x, tokens, with_entropy=True, invariant=True)
    route = type(resolve_backend(None, torch.device("cpu"), invariant=True)).__name__
    out[cache] = {"values": [v.tolist() for v in values], "route": route,
                  "warnings": [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]}
print(json.dumps(out))
"""

FOREIGN_SOURCE = "int not_the_kernel(void) { return 1; }\n"


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """{case: (cache root, the kernel's library path there)}: one intact build copied into each
    cache, then damaged per case."""
    cc = compiler()
    if cc is None:
        pytest.skip("no C compiler: the kernel is never built here")
    root = tmp_path_factory.mktemp("native-caches")
    built = build(cc, root / "built")
    foreign = root / "foreign.so"
    (root / "foreign.c").write_text(FOREIGN_SOURCE)
    subprocess.run([cc, "-shared", "-fPIC", str(root / "foreign.c"), "-o", str(foreign)], check=True)
    with foreign.open("ab") as f:  # padded to the kernel's size: only its digest tells it apart
        f.truncate(max(built.stat().st_size, foreign.stat().st_size))
    out = {}
    for case in ("intact", "truncated", "foreign", "foreign, no record", "damaged record", "foreign, recorded"):
        directory = root / case.replace(", ", "-").replace(" ", "-") / "megatron_rl_patches" / "native"
        directory.mkdir(parents=True)
        library = directory / built.name
        shutil.copy(built, library)
        if record_path(built).exists():  # (absent where the build writes none: the code before its fix)
            shutil.copy(record_path(built), record_path(library))
        out[case] = (directory.parents[1], library)
    truncated = out["truncated"][1]
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    for case in ("foreign", "foreign, no record", "foreign, recorded"):
        shutil.copy(foreign, out[case][1])
    record_path(out["foreign, no record"][1]).unlink(missing_ok=True)
    record_path(out["damaged record"][1]).write_text("not a record\n")
    recorded = out["foreign, recorded"][1]  # a record that vouches for the foreign file: the loader's own check
    os.replace(write_record(recorded, recorded), record_path(recorded))
    (root / "a-file").write_text("")  # a cache root under a file: nothing can be written there
    out["unwritable"] = (root / "a-file" / "cache", root / "a-file" / "cache" / "megatron_rl_patches" / "native")
    return out


@pytest.fixture(scope="module")
def ran(caches):
    """The script over every cache in one fresh process: its exit code, stderr and results."""
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *(str(root) for root, _ in caches.values())],
                          capture_output=True, text=True, timeout=300)
    results = json.loads(proc.stdout) if proc.returncode == 0 else {}
    return proc, {case: results.get(str(root)) for case, (root, _) in caches.items()}


def test_a_damaged_cache_never_ends_the_process(ran):
    proc, _ = ran
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])  # before: -7 (SIGBUS) on the truncated file


def test_the_intact_cache_is_loaded_as_it_is(ran, caches):
    _, results = ran
    assert results["intact"]["route"] == "InvariantNative" and results["intact"]["warnings"] == []


@pytest.mark.parametrize("case, reason", [
    ("truncated", "bytes where its build wrote"),
    ("foreign", "another SHA-256"),
    ("foreign, no record", "has no record of its build"),
    ("damaged record", "has a damaged record"),
])
def test_a_damaged_library_is_rebuilt_with_one_warning_naming_it(ran, caches, case, reason):
    _, results = ran
    got, library = results[case], caches[case][1]
    assert got["route"] == "InvariantNative" and got["values"] == results["intact"]["values"], case
    assert len(got["warnings"]) == 1 and str(library) in got["warnings"][0], got["warnings"]
    assert reason in got["warnings"][0] and "rebuilding it" in got["warnings"][0], got["warnings"]
    assert mismatch(library) is None  # the rebuilt file and its record


def test_a_recorded_library_without_the_kernel_is_named_and_the_serial_build_serves(ran, caches):
    _, results = ran
    got, library = results["foreign, recorded"], caches["foreign, recorded"][1]
    assert got["route"] == "InvariantNative" and got["values"] == results["intact"]["values"]
    assert len(got["warnings"]) == 1, got["warnings"]
    assert f"{library} has no invariant_row_sums" in got["warnings"][0], got["warnings"]


def test_load_names_a_library_without_the_kernel(caches):
    library = caches["foreign, recorded"][0] / "probe.so"
    shutil.copy(Path(caches["intact"][1]).parents[3] / "foreign.so", library)
    with pytest.raises(OSError, match=f"{library} has no invariant_row_sums"):  # before: AttributeError
        load(library)


def test_a_cache_that_cannot_be_written_still_gives_the_kernel(ran, caches):
    """Before: the torch tiles served silently (about 1.35x the default op's time)."""
    _, results = ran
    got = results["unwritable"]
    assert got["route"] == "InvariantNative" and got["values"] == results["intact"]["values"]
    assert len(got["warnings"]) == 1 and f"cache {caches['unwritable'][1]} cannot be written" in got["warnings"][0]
