"""What a benchmark case measures: its memory (the CUDA allocator's peak, or the resident set's
high-water mark on CPU: `MemoryProbe`), the bytes saved for backward (`SavedBytes`) and its best
wall time (`best_time`)."""
# lazy imports: import cost: `bench` parses its arguments through gpu.py, before torch (test_light_usage_errors)
from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

MIB = 1 << 20
# On CPU memory is the resident set's high-water mark, which moves in allocator-sized steps:
# below this many bytes per U its figures are noise and are left out (quick runs). The CUDA
# allocator's peak is exact.
RSS_RESOLUTION = 64 << 20
BELOW_RESOLUTION = "memory below measurement resolution (U < 64 MiB)"


def memory_resolved(unit_bytes: int, device: str) -> bool:
    """Whether peak figures in units of `unit_bytes` mean anything on `device`."""
    return device.startswith("cuda") or unit_bytes >= RSS_RESOLUTION


# ------------------------------------------------------------------------------- memory


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            match = re.search(rf"^{field}:\s+(\d+) kB", fh.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def _rss_bytes() -> int:
    kib = _proc_status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    import psutil  # lazy: import cost: a non-Linux fallback; Linux reads /proc

    return psutil.Process().memory_info().rss


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return _proc_status_kib("VmHWM") is not None


def _peak_rss_bytes() -> int:
    kib = _proc_status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    import resource  # lazy: optional dependency resource: a POSIX-only standard module

    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


class MemoryProbe:
    """Memory above a baseline taken by :meth:`start`: the CUDA caching allocator's counters on
    GPU, the process's resident set on CPU (peak via the kernel's high-water mark, reset at
    start where Linux allows; otherwise the lifetime peak, meaningful in a fresh process)."""

    def __init__(self, device: str = "cpu") -> None:
        import torch

        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.peak_reset = False
        self._base = 0

    def start(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            self.peak_reset = True
        else:
            self.peak_reset = reset_peak_rss()
            self._base = _rss_bytes()

    def current(self) -> int:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_allocated(self.device) - self._base
        return _rss_bytes() - self._base

    def peak(self) -> int:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self._base
        return _peak_rss_bytes() - self._base


class SavedBytes:
    """Bytes autograd saves for backward inside the block, each storage counted once.

    Storages of `ignore` (e.g. weights that exist anyway) are not counted.
    """

    def __init__(self, ignore: Iterable[Any] = ()) -> None:
        self._ignore = {t.untyped_storage().data_ptr() for t in ignore}
        self.storages: dict[int, int] = {}
        self._hooks: Any = None

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def _pack(self, tensor: Any) -> Any:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._ignore:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self) -> SavedBytes:
        import torch

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def best_time(fn: Callable[[], Any], *, repeat: int = 3, warmup: int = 1, sync: Callable[[], Any] | None = None,
              setup: Callable[[], Any] | None = None) -> float:
    """Shortest wall time of ``fn(setup())`` (or ``fn()``) over `repeat` runs, after `warmup` runs."""
    times = []
    for i in range(warmup + repeat):
        arg = setup() if setup is not None else None
        if sync:
            sync()
        start = time.perf_counter()
        fn(arg) if setup is not None else fn()
        if sync:
            sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
        del arg
    return min(times)
