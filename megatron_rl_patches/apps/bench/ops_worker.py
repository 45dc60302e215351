"""One timed op of `bench ops`, run as a script in its own process: ``python ops_worker.py
'{"op": ..., "T": ..., "V": ..., "H": ..., "k": ..., "repeats": ...}'``. It imports the ops from
whatever ``megatron_rl_patches`` is first on PYTHONPATH (today's or a baseline revision's), and
nothing else of the package, so one worker times every revision alike. Prints one JSON line."""
# lazy imports: order: main() silences warnings before torch and the ops load (ops.divergence: today's revision only)
from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
import time
import warnings
from collections.abc import Callable


def _slime_function():
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slime_reference.py")
    spec = importlib.util.spec_from_file_location("slime_reference", here)
    assert spec is not None and spec.loader is not None  # the file beside this one
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SoftmaxKeeping


def _step(op: str, T: int, V: int, H: int, k: int, dtype: str = "float32",
          clock: Callable[[], float] = time.perf_counter) -> Callable[[], float]:
    """A closure running `op` once on fresh inputs: forward and, where it has one, backward to the
    gradient of its inputs (``autograd.grad``: no ``.grad`` accumulation, which would copy a
    gradient that shares the logits' storage); returns the seconds of that alone, the inputs'
    preparation (a [T, V] clone) not counted."""
    import torch

    from megatron_rl_patches.ops import lm_head, logprobs, topk

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (T,), generator=g)
    a, b = torch.randn(T, generator=g), torch.randn(T, generator=g)
    fused = op.startswith("lm_head") or op == "logits_path"  # hidden states and an output weight
    inputs = getattr(torch, dtype)
    if fused:
        hidden = torch.randn(T, H, generator=g).to(inputs)
        weight = (torch.randn(V, H, generator=g) / H**0.5).to(inputs)
    else:
        base = (torch.randn(T, V, generator=g) * 3).to(inputs)
    ids = torch.arange(k) * (V // k) + torch.randint(0, V // k, (T, 1), generator=g)  # k distinct ids per row

    def logits_leaf():
        leaf = base.clone().requires_grad_(True)
        return leaf, leaf * 1.0  # a non-leaf, as a model's logits

    def timed(run: Callable[[], object]) -> float:
        start = clock()
        run()
        return clock() - start

    def grad_of(loss: torch.Tensor, inputs: list[torch.Tensor]) -> None:
        torch.autograd.grad(loss, inputs)

    def lp_entropy(inplace: bool) -> float:
        leaf, x = logits_leaf()

        def run() -> None:
            lp, ent = logprobs.log_probs_and_entropy(x, tokens, with_entropy=True, inplace_backward=inplace)
            assert ent is not None  # with_entropy
            grad_of((a * lp).sum() + (b * ent).sum(), [x])

        return timed(run)

    def slime() -> float:
        leaf, x = logits_leaf()

        def run() -> None:
            lp, ent = _slime_function().apply(x, tokens, True)
            grad_of((a * lp).sum() + (b * ent).sum(), [x])

        return timed(run)

    def topk_lp() -> float:
        leaf, x = logits_leaf()

        def run() -> None:
            logp, tail = topk.topk_logprobs(x, ids)
            grad_of(logp.sum() + (a * tail).sum(), [x])

        return timed(run)

    def kl(**options: str) -> float:
        """20 calls of topk_kl on [T, k+1] buckets; `options` name the divergence (kl="reverse"
        is the only spelling aaec6bb knows)."""
        student = torch.log_softmax(torch.randn(T, k + 1, generator=g), dim=1).requires_grad_(True)
        teacher = torch.log_softmax(torch.randn(T, k + 1, generator=g), dim=1)

        def run() -> None:
            for _ in range(20):
                value = topk.topk_kl(student[:, :k], student[:, k], teacher[:, :k], teacher[:, k], **options)
                grad_of(value.sum(), [student])

        return timed(run)

    def modes(fused_head: bool, invariant: bool, backward: bool) -> float:
        """log-prob + entropy in the default or the invariant mode, forward alone (no graph) or with
        the gradient of its inputs (the logits, or hidden and weight)."""
        inputs = [hidden.clone().requires_grad_(backward), weight.clone().requires_grad_(backward)] if fused_head \
            else [base.clone().requires_grad_(backward)]

        def run() -> None:
            with torch.set_grad_enabled(backward):
                if fused_head:
                    lp, ent = lm_head.lm_head_log_probs_and_entropy(inputs[0], inputs[1], tokens, with_entropy=True,
                                                                    invariant=invariant)
                else:
                    lp, ent = logprobs.log_probs_and_entropy(inputs[0] * 1.0 if backward else inputs[0], tokens,
                                                             with_entropy=True, invariant=invariant)
                assert ent is not None  # with_entropy
                if backward:
                    grad_of((a * lp).sum() + (b * ent).sum(), inputs)

        return timed(run)

    def divergence(name: str) -> float:
        from megatron_rl_patches.ops.divergence import lm_head_divergence

        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        teacher_h = torch.randn(T, H, generator=g)
        teacher_w = torch.randn(V, H, generator=g) / H**0.5

        def run() -> None:
            grad_of((a * lm_head_divergence(h, w, teacher_h, teacher_w, divergence=name)).sum(), [h, w])

        return timed(run)

    def head(kind: str) -> float:
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)

        def run() -> None:
            if kind == "logits_path":
                lp, ent = logprobs.log_probs_and_entropy(h @ w.t(), tokens, with_entropy=True)
            elif kind == "lp":
                lp, ent = lm_head.lm_head_log_probs_and_entropy(h, w, tokens, with_entropy=True)
            else:
                logp, tail = lm_head.lm_head_topk_logprobs(h, w, ids)
                grad_of(logp.sum() + (a * tail).sum(), [h, w])
                return
            assert ent is not None  # with_entropy
            grad_of((a * lp).sum() + (b * ent).sum(), [h, w])

        return timed(run)

    steps: dict[str, Callable[[], float]] = {
        "log_probs_and_entropy": lambda: lp_entropy(False),
        "log_probs_and_entropy_inplace": lambda: lp_entropy(True),
        "slime_logprobs": slime,
        "topk_ids": lambda: timed(lambda: topk.topk_ids(base, k)),
        "topk_logprobs": topk_lp,
        "topk_kl": lambda: kl(kl="reverse"),
        "lm_head_log_probs_and_entropy": lambda: head("lp"),
        "logits_path": lambda: head("logits_path"),
        "lm_head_topk_ids": lambda: timed(lambda: lm_head.lm_head_topk_ids(hidden, weight, k)),
        "lm_head_topk_logprobs": lambda: head("topk"),
        "topk_kl_jsd": lambda: kl(divergence="jsd"),
        "lm_head_divergence_jsd": lambda: divergence("jsd"),
        "lm_head_divergence_forward_kl": lambda: divergence("forward_kl"),
        "lm_head_divergence_mixed_kl": lambda: divergence("mixed_kl"),
    }
    for fused_head, name in ((False, "log_probs_and_entropy"), (True, "lm_head_log_probs_and_entropy")):
        for invariant, mode in ((False, "default"), (True, "invariant")):
            for backward, part in ((False, "forward"), (True, "forward_backward")):
                steps[f"{name}:{mode}:{part}"] = functools.partial(modes, fused_head, invariant, backward)
    return steps[op]


def main(argv: list[str]) -> int:
    import torch

    warnings.simplefilter("ignore")
    case = json.loads(argv[0])
    threads = case.get("threads", 1)
    torch.set_num_threads(threads)
    # one thread: the thread's CPU time (what a loaded machine moves least); more: wall time
    clock = time.thread_time if threads == 1 and case.get("cpu_time") else time.perf_counter
    step = _step(case["op"], case["T"], case["V"], case["H"], case["k"], case.get("dtype", "float32"), clock)
    best = float("inf")
    for _ in range(case.get("repeats", 1)):
        best = min(best, step())
    print(json.dumps({"op": case["op"], "time_s": best}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
