"""Error against float64 of the recorded golden results and of the current code, case by case.

    python tools/golden_errors.py RECORDED.pt   # this capability's results in it (else AVX2's)

The reference runs the same cases with every op computing in float64 (the compute dtype patched),
on the same (rounded) inputs. Prints one row per key whose result changed: max |recorded - ref|,
max |now - ref| and their ratio; exits 1 if any error grew by more than one ulp at max(1, |ref|).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kit"))
import golden_cases  # noqa: E402

from megatron_rl_patches.ops import _stats, _vocab  # noqa: E402


def _float64_cases() -> dict[str, torch.Tensor]:
    real = _stats.compute_dtype
    _stats.compute_dtype = _vocab.compute_dtype = lambda dtype: torch.float64
    try:
        return golden_cases.cases()
    finally:
        _stats.compute_dtype = _vocab.compute_dtype = real


def main(recorded_path: str) -> int:
    recorded, ref = golden_cases.recorded(Path(recorded_path))[0], _float64_cases()
    now = golden_cases.pinned(golden_cases.single_cases, 1)[0]  # as the golden test computes them
    grew = 0
    print(f"{'key':44} {'recorded err':>13} {'now err':>13} {'now/recorded':>12}")
    for key in sorted(recorded):
        before, after = recorded[key], now[key]
        if torch.equal(before.nan_to_num(), after.nan_to_num()) or not before.is_floating_point():
            continue
        want = ref[key].double()
        finite = torch.isfinite(want)
        err_before = float((before.double() - want)[finite].abs().max()) if finite.any() else 0.0
        err_after = float((after.double() - want)[finite].abs().max()) if finite.any() else 0.0
        # noise: one unit in the last place of the result's dtype at max(1, largest magnitude), the
        # scale convention of the ops' tolerances (1e-5·max(1, |ref|) for fp32)
        scale = max(1.0, float(want[finite].abs().max())) if finite.any() else 1.0
        ulp = torch.finfo(after.dtype).eps * scale
        flag = ""
        if err_after > err_before + ulp:
            grew += 1
            flag = "  GREW"
        ratio = err_after / err_before if err_before else float("inf") if err_after else 1.0
        print(f"{key:44} {err_before:13.3e} {err_after:13.3e} {ratio:12.3f}{flag}")
    print(f"{grew} case(s) whose error grew by more than one ulp")
    return 1 if grew else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
