"""verl 0.9.1's two log-prob + entropy routes from the final hidden states (the verl lane only):
its unfused route (the output layer's [T, V] logits, then verl's own
`MegatronEngineWithLMHead._lm_head_logits_processor`: temperature divided in place, a clone for
entropy, verl's vocab-parallel ops) against its fused route with our processor (patch
`verl_fused_logprobs`: the adapter over the fused LM head). Both: forward + backward of
Σ a·log p + b·H down to hidden and weight; excess peak in U = T·V·4 bytes, measured as
`bench.fused` does (fresh process, resident high-water mark minus the gradients).

    PYTHONPATH=.lanes/verl .venv-mcore019/bin/python -m megatron_rl_patches.apps.bench.verl_routes
"""
# lazy imports: import cost: torch and megatron-core load when a benchmark runs (in its case workers mostly)
from __future__ import annotations

import types
from typing import Any

from megatron_rl_patches.apps.bench import measure, outputs, runner
from megatron_rl_patches.apps.bench.fused import head_inputs

ROUTES = ("verl unfused", "verl fused + ours")
SHAPE = {"T": 4096, "V": 32000, "H": 1024}


def _unfused(hidden, weight, tokens, temperature):
    """verl's unfused route: full logits from the output layer, then verl's logits processor."""
    import torch
    from verl.workers.config import McoreEngineConfig  # lazy: optional dependency verl
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead  # lazy: optional dependency verl

    engine = object.__new__(MegatronEngineWithLMHead)
    engine.engine_config = McoreEngineConfig(use_mbridge=True)
    logits = (hidden @ weight.T)[None]  # [1, T, V]: what the output layer gives on verl's thd input
    out = engine._lm_head_logits_processor(
        logits, tokens[None], torch.full((1, tokens.numel()), temperature), calculate_sum_pi_squared=False,
        calculate_entropy=True, distillation_use_topk=False, distillation_only=False,
        logits_processor_func=None, batch=None, data_format="thd",
    )
    return out["log_probs"][0], out["entropy"][0]


def _fused(hidden, weight, tokens, temperature):
    """verl's fused output-processor call, served by `verl_fused_logprobs`' adapter."""
    import torch
    from verl.models.mcore.model_forward_fused import FusedOutputProcessorContext  # lazy: optional dependency verl

    from megatron_rl_patches.integrations.verl.fused import fused_output_processor

    layer = torch.nn.Module()
    layer.weight = weight
    out = fused_output_processor(hidden_states=hidden[:, None], output_layer=layer, output_weight=None,
                                 labels=tokens[None], context=FusedOutputProcessorContext(temperature), config=None)
    return out.log_probs, out.entropy


def route_case(probe: measure.MemoryProbe, *, route: str, T: int, V: int, H: int, repeat: int = 1,
               temperature: float = 1.0) -> dict:
    """One route at one shape, in a fresh worker (megatron's parallel state on CPU for verl's ops)."""
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    impl = {"verl unfused": _unfused, "verl fused + ours": _fused}[route]
    with megatron_on_cpu():
        small = head_inputs(8, 64, 16, "cpu")  # imports and first-call set-up stay out of the peak
        impl(*small[:3], temperature)
        hidden, weight, tokens, a, b = head_inputs(T, V, H, "cpu")

        def step(_: Any = None) -> None:
            hidden.grad = weight.grad = None
            log_probs, entropy = impl(hidden, weight, tokens, temperature)
            ((a * log_probs).sum() + (b * entropy).sum()).backward()

        probe.start()
        step()
        peak = probe.peak()
        unavoidable = hidden.grad.nbytes + weight.grad.nbytes
        seconds = measure.best_time(step, repeat=repeat, warmup=0)
    return {"excess_bytes": peak - unavoidable, "time_s": seconds, "peak_reset": probe.peak_reset}


def run(T: int = SHAPE["T"], V: int = SHAPE["V"], H: int = SHAPE["H"]) -> list[dict]:
    """Both routes at one shape (one fresh process each); rows with excess peak in U and time ratio."""
    cases = [{"target": "megatron_rl_patches.apps.bench.verl_routes:route_case",
              "kwargs": {"route": route, "T": T, "V": V, "H": H}} for route in ROUTES]
    results = runner.run_cases(cases, isolate=True, threads=1, timeout=1800.0)
    unit = T * V * 4
    rows = [types.SimpleNamespace(route=route, **result) for route, result in zip(ROUTES, results)]
    base = next((r.time_s for r in rows if r.route == "verl unfused" and hasattr(r, "time_s")), None)
    table = []
    for row in rows:
        if hasattr(row, "error"):
            table.append({"shape": f"{T}x{V}", "route": row.route, "note": row.error})
            continue
        table.append({"shape": f"{T}x{V}", "route": row.route, "excess_peak_U": round(row.excess_bytes / unit, 3),
                      "excess_peak_MiB": round(row.excess_bytes / 2**20, 1), "time_s": round(row.time_s, 1),
                      "time_vs_unfused": round(row.time_s / base, 2) if base else None})
    return table


if __name__ == "__main__":
    outputs.print_table(run(), ("shape", "route", "excess_peak_U", "excess_peak_MiB", "time_s", "time_vs_unfused",
                               "note"), title="verl 0.9.1: unfused route vs fused route with our processor (CPU)")
