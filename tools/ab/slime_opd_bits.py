"""Bit-identity of slime's OPD step across two revisions: what the slime lane's multi-rank worlds
return (the OPD rollout fields: ids, masks, the teachers' scores; the first step's losses and
gradients; the states) dumped at each revision, then compared with torch.equal.

1. As a pytest plugin (this folder on PYTHONPATH, `-p slime_opd_bits`), with SLIME_OPD_BITS=DIR:
   every `run_multirank` result of the tests run is saved to DIR/<test id>-<n>.pt.
2. `python tools/ab/slime_opd_bits.py DIR_A DIR_B [--added]`: each file of DIR_A against DIR_B's, field
   by field (timings left out); one line per file, exit status 1 on any difference or missing file
   (`--added`: fields only B's newer test kit records are named and left out).

For instance, per revision tree TREE (a `git worktree add --detach`), from TREE:

    SLIME_OPD_BITS=/tmp/bits-REV PYTHONPATH=TREE:TREE/tools/ab:LANES... python -m pytest -m slime \\
        -p slime_opd_bits tests/integrations/slime/lane/test_slime_opd_served_lane.py -k "1"
"""
from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch

TIMINGS = re.compile(r"(seconds|_s)$")
_current = {"test": "outside", "count": 0}


def pytest_configure(config: Any) -> None:
    """Records every run_multirank result while SLIME_OPD_BITS names a folder."""
    folder = os.environ.get("SLIME_OPD_BITS")
    if not folder:
        return
    from megatron_rl_patches.testing import multirank

    real = multirank.run_multirank

    def recording(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        _current["count"] += 1
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", _current["test"])
        Path(folder).mkdir(parents=True, exist_ok=True)
        torch.save(result, Path(folder) / f"{name}-{_current['count']}.pt")
        return result

    multirank.run_multirank = recording


def pytest_runtest_setup(item: Any) -> None:
    _current["test"], _current["count"] = item.nodeid.split("::", 1)[-1], 0


def differences(a: Any, b: Any, where: str = "", added: set[str] | None = None) -> list[str]:
    """Where `a` and `b` differ: tensors by torch.equal (dtype and shape too), containers item by item.
    `added`: keys B's test kit records that A's did not (left out, named by `main`)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and \
            a.shape == b.shape and torch.equal(a, b)
        return [] if same else [where or "."]
    if isinstance(a, dict) and isinstance(b, dict):
        extra = set(map(str, b)) - set(map(str, a))
        if a.keys() - b.keys() or (extra and added is None):
            return [f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"]
        if added is not None:
            added.update(f"{where}.{key}" for key in extra)
        return [d for key in a if not TIMINGS.search(str(key))
                for d in differences(a[key], b[key], f"{where}.{key}", added)]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: {len(a)} vs {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]", added)]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def fields(value: Any) -> int:
    """How many tensors a result holds."""
    if isinstance(value, torch.Tensor):
        return 1
    if isinstance(value, dict):
        return sum(fields(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(fields(v) for v in value)
    return 0


def main(a: str, b: str, *options: str) -> int:
    """`--added`: keys only B records (a newer test kit's) are named and left out, not a difference."""
    status = 0
    names = sorted({p.name for p in Path(a).glob("*.pt")} | {p.name for p in Path(b).glob("*.pt")})
    for name in names:
        if not (Path(a) / name).exists() or not (Path(b) / name).exists():
            print(f"MISSING {name}")
            status = 1
            continue
        left, right = (torch.load(Path(d) / name, weights_only=False) for d in (a, b))
        added: set[str] | None = set() if "--added" in options else None
        found = differences(left, right, added=added)
        where = ": " + ", ".join(found[:5]) if found else ""
        besides = f" (B's kit also records {', '.join(sorted({k.split('.')[-1] for k in added}))})" if added else ""
        print(f"{'DIFFER' if found else 'EQUAL '} {name}: {fields(left)} tensors{where}{besides}")
        status |= bool(found)
    return status


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
