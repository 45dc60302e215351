"""The invariant CPU kernel (:mod:`.source`) compiled with the system's C compiler at first use and
cached by the hash of its source, flags, compiler and CPU; None where the setting turns it off or
no compiler builds it (the torch invariant tiles then serve). A cached library is loaded only when
it is the file its build recorded (:mod:`.record`); else it is rebuilt, with one warning naming it."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

from megatron_rl_patches import settings
from megatron_rl_patches.ops.kernels.native.record import mismatch, record_path, write_record
from megatron_rl_patches.ops.kernels.native.source import SOURCE

# IEEE operations only, never contracted into FMAs: a vector lane and a scalar loop give the same bits
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fPIC", "-shared")
# rows over threads with OpenMP (libgomp.so.1: the one torch has loaded); a compiler without it builds serial
THREADED = ("-fopenmp",)


def compiler() -> str | None:
    """$CC, else cc or gcc on PATH."""
    named = settings.c_compiler()
    return shutil.which(named) if named else (shutil.which("cc") or shutil.which("gcc"))


def cache_dir() -> Path:
    return Path(settings.cache_root()) / "megatron_rl_patches" / "native"


def _cpu_signature() -> str:
    """The CPU's flags (-march=native builds for them): a cached build moved to another CPU is rebuilt."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.processor()


def build(cc: str, directory: Path, flags: tuple[str, ...] = FLAGS + THREADED) -> Path:
    """The shared library in `directory`: the cached one when it is the file its build recorded,
    else built there (CalledProcessError if `cc` fails, OSError if the directory is not writable);
    a cached file that does not match its record is rebuilt with a warning naming it."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256("\0".join((SOURCE, *flags, version, _cpu_signature(), platform.machine())).encode())
    library = directory / f"invariant_sums_{key.hexdigest()[:16]}.so"
    if library.exists():
        wrong = mismatch(library)
        if wrong is None:
            return library
        warnings.warn(f"the cached invariant CPU kernel {library} {wrong}: not loaded, rebuilding it",
                      RuntimeWarning, stacklevel=2)
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as work:  # concurrent builders each rename whole files
        source = Path(work) / "invariant_sums.c"
        source.write_text(SOURCE)
        built = Path(work) / library.name
        subprocess.run([cc, *flags, str(source), "-o", str(built)], check=True, capture_output=True, timeout=300)
        record = write_record(built, library)
        # the library first, its record after: a record never describes a file not yet in place
        os.replace(built, library)
        os.replace(record, record_path(library))
    return library


@functools.cache
def _loaded(cc: str | None, directory: str) -> ctypes.CDLL | None:
    if cc is None:
        return None
    for flags in (FLAGS + THREADED, FLAGS):
        try:
            library = build(cc, Path(directory), flags)
        except subprocess.SubprocessError:
            continue  # no build with these flags (no OpenMP): the next, else the torch tiles
        except OSError as exc:  # a cache that cannot be written: built for this process alone
            own = _built_for_this_process(cc, directory, flags, exc)
            if own is None:
                continue
            library = own
        try:
            return load(library)
        except OSError as exc:  # a library its record vouches for that still does not load
            warnings.warn(f"the invariant CPU kernel could not be loaded: {exc}; the serial build or the torch "
                          "invariant tiles serve", RuntimeWarning, stacklevel=2)
    return None


def _built_for_this_process(cc: str, directory: str, flags: tuple[str, ...], why: OSError) -> Path | None:
    """The library built in a temporary directory of its own, with one warning naming the cache
    that could not be written (without it the torch tiles would serve silently: about 1.35x the
    default op's time, docs/benchmarks.md); None where that build fails too."""
    try:
        library = build(cc, Path(tempfile.mkdtemp(prefix="megatron_rl_patches_native_")), flags)
    except (OSError, subprocess.SubprocessError):
        return None
    warnings.warn(f"the invariant CPU kernel's cache {directory} cannot be written ({why.strerror or why}): "
                  f"built in {library.parent} for this process (about 2 s at each start); point XDG_CACHE_HOME "
                  "at a writable directory to keep it", RuntimeWarning, stacklevel=3)
    return library


def load(path: Path) -> ctypes.CDLL:
    """A built library with its function's signature declared (OSError naming `path` when it
    lacks the kernel's function)."""
    library = ctypes.CDLL(str(path))
    try:
        function = library.invariant_row_sums
    except AttributeError as exc:
        raise OSError(f"{path} has no invariant_row_sums: not the invariant CPU kernel's library") from exc
    function.restype = None
    function.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    return library


def native_library() -> ctypes.CDLL | None:
    """The compiled kernel, or None: the setting off (MEGATRON_RL_PATCHES_NATIVE=0), no compiler, or
    its build failed."""
    if not settings.native():
        return None
    return _loaded(compiler(), str(cache_dir()))
