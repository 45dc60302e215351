"""Driver run in a fresh interpreter by test_residency_user_ops.py: what user code does with a
swap/stream teacher between forwards, each result compared with the resident build's. A crash
(SIGSEGV) ends this process with a non-zero code, which the test reports; garbage compares
unequal. argv: the path to save the results to (a dict: check -> True or the error), named
after the residency mode to test: swap.pt or stream.pt."""
from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _same_state(a: dict, b: dict) -> bool:
    tensors = [k for k, v in a.items() if isinstance(v, torch.Tensor)]
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in tensors
    )


def main(out: str, mode: str) -> None:
    from megatron_rl_patches import build_inference_model, residency_report
    from megatron_rl_patches.inference.residency.storage import device_weight_bytes
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu, tiny_gpt_config, tiny_gpt_provider

    # a Megatron model holds process-group handles, which cannot be copied (the resident build's
    # deepcopy fails on them too): copies share them, as a user copying such a model must
    copy._deepcopy_dispatch[torch.distributed.ProcessGroup] = lambda group, memo: group  # type: ignore[attr-defined]
    results: dict[str, Any] = {}

    def check(name: str, fn: Callable[[], bool]) -> None:
        try:
            results[name] = bool(fn())
        except Exception as exc:  # a clear error is a result too; a crash never gets here
            results[name] = f"{type(exc).__name__}: {exc}"

    with megatron_on_cpu() as env:
        def build(residency: str = "resident", seed: int = 3) -> Any:
            provider = tiny_gpt_provider(tiny_gpt_config(num_layers=3), seed=seed)
            return build_inference_model(provider, residency=residency)[0]

        ref, model = build(), build(mode)
        batch = env.batch(seed=1)
        want = env.forward(ref, batch)
        results["first forward"] = torch.equal(env.forward(model, batch), want)  # between forwards from here
        pairs = list(zip(ref.parameters(), model.parameters()))

        def forward_equal(chunk: Any, expected: torch.Tensor = want) -> bool:
            return torch.equal(env.forward(chunk, batch), expected)

        check("no device bytes between forwards", lambda: device_weight_bytes(model.parameters()) == 0)
        check("shape, dtype, device", lambda: all(
            (p.shape, p.dtype, p.device) == (q.shape, q.dtype, q.device) for p, q in pairs))
        check("p.sum()", lambda: all(torch.equal(p.sum(), q.sum()) for p, q in pairs))
        check("p.clone()", lambda: all(torch.equal(p.clone(), q.clone()) for p, q in pairs))
        check("p.norm()", lambda: all(torch.equal(p.norm(), q.norm()) for p, q in pairs))
        check("torch.cat", lambda: torch.equal(torch.cat([p.flatten() for p, _ in pairs]),
                                               torch.cat([q.flatten() for _, q in pairs])))
        check("p.detach().numpy()", lambda: all(
            np.array_equal(p.detach().numpy(), q.detach().numpy()) for p, q in pairs))
        check("state_dict()", lambda: _same_state(model.state_dict(), ref.state_dict()))

        def save_then_load_resident() -> bool:
            path = out + ".state.pt"
            torch.save(model.state_dict(), path)
            resident = build(seed=99)
            resident.load_state_dict(torch.load(path, weights_only=True))
            return _same_state(resident.state_dict(), ref.state_dict()) and forward_equal(resident)

        check("torch.save(state_dict()) loads into a resident build", save_then_load_resident)

        def deep_copy() -> bool:
            twin = copy.deepcopy(model)
            apart = all(p.data_ptr() != q.data_ptr() for p, q in zip(twin.parameters(), model.parameters()))
            ok = apart and _same_state(twin.state_dict(), ref.state_dict())
            ok = ok and forward_equal(twin) and forward_equal(model)
            return ok and residency_report([twin]).mode == mode and device_weight_bytes(twin.parameters()) == 0

        check("copy.deepcopy(chunk)", deep_copy)

        def load_other_weights() -> bool:
            other = build(seed=7)
            model.load_state_dict(other.state_dict())
            ok = forward_equal(model, env.forward(other, batch)) and _same_state(model.state_dict(), other.state_dict())
            model.load_state_dict(ref.state_dict())
            return ok and forward_equal(model)

        check("load_state_dict", load_other_weights)

        def converted(convert: Callable[[Any], Any]) -> bool:
            twin, ref64 = convert(copy.deepcopy(model)), convert(copy.deepcopy(ref))
            ok = all(q.dtype == torch.float64 for q in twin.parameters())
            ok = ok and _same_state(twin.state_dict(), ref64.state_dict())
            ok = ok and forward_equal(twin, env.forward(ref64, batch))
            return ok and device_weight_bytes(twin.parameters()) == 0 and forward_equal(model)

        check("chunk.double()", lambda: converted(lambda m: m.double()))
        check("chunk.to(torch.float64)", lambda: converted(lambda m: m.to(torch.float64)))
        check("chunk.to('cpu')", lambda: model.to("cpu") is model and forward_equal(model))
        check("no device bytes at the end", lambda: device_weight_bytes(model.parameters()) == 0)
    torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[1]).stem)
