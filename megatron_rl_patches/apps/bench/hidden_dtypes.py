"""`bench hidden-dtypes`: what each dtype a pooling server's hidden states can travel in
(`ServedTeacher(hidden_dtype=...)`: vLLM's `embed_dtype` float32 / bfloat16 / float16 / fp8_e4m3 /
fp8_e5m2) costs in bytes per token and in error.

The states: a float32 checkpoint's final (normed) hidden states from transformers' forward
(the kit's random Qwen3 — no checkpoint with trained weights installs from the package index —
4 layers, hidden 256, vocab 32000, 4 x 512 random tokens). The reference: its float32 states
through its head in float64 (float32 is that model's own dtype: exact). Each dtype: the same states
cast as vLLM casts them (`tensor.to(dtype)`) and back, through the same float64 head. Per dtype,
against the reference: the actual tokens' log-probs (mean and largest |error|), the reference's
top-64 ids' log-probs and the tail outside them (the largest |error| over rows and buckets), and the whole vocabulary's
forward KL(reference || dtype) and reverse KL(dtype || reference) per row (mean and largest): the
divergence the transport alone adds to a distillation loss. A random model's head is nearly
uniform (entropy near log V); the errors grow with the logits' spread, so every figure is also
given with the head scaled until the rows' mean entropy is 2 nats (`head`: "x s"). --quick: the
kit's tiny Qwen3, 2 x 16 tokens."""
# lazy imports: import cost: torch and transformers load when the benchmark runs
from __future__ import annotations

import os
import tempfile
from typing import Any

from megatron_rl_patches.apps.bench.benchmark_run import Bars, run_benchmark

FULL: dict[str, Any] = {"config": dict(vocab_size=32000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=1024),
        "rows": 4, "length": 512, "k": 64}
QUICK: dict[str, Any] = {"config": dict(vocab_size=1001), "rows": 2, "length": 16, "k": 8}
DTYPE_NAMES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
EMBED_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "float8_e4m3fn": "fp8_e4m3",
               "float8_e5m2": "fp8_e5m2"}
TARGET_ENTROPY = 2.0  # nats: the sharpened head's mean row entropy
BIG_H = 5120
COLUMNS = ("head", "entropy", "embed_dtype", "bytes_per_token", "bytes_at_H5120", "token_lp_mean_err",
           "token_lp_max_err", "topk_tail_max_err",
           "fwd_kl_mean", "fwd_kl_max", "rev_kl_mean", "rev_kl_max", "max_abs_state")


def hidden_states(plan: dict, root: str):
    """(the final hidden states [T, H] float32, the tokens they predict [T], the head [V, H] float32)."""
    import torch

    from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf

    model = save_tiny_hf(os.path.join(root, "qwen3"), "qwen3", seed=3, **plan["config"])
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (plan["rows"], plan["length"] + 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        states = model.model(input_ids=ids[:, :-1]).last_hidden_state
    return states.reshape(-1, states.shape[-1]).float(), ids[:, 1:].reshape(-1), model.lm_head.weight.detach().float()


def log_softmax64(states, weight, chunk: int = 256):
    """log softmax(states @ weight^T) in float64, [T, V] (built chunk by chunk of rows)."""
    import torch

    weight = weight.double()
    return torch.cat([torch.log_softmax(part.double() @ weight.T, dim=-1) for part in states.split(chunk)])


def sharpened(states, weight, target: float) -> float:
    """The head's scale at which the rows' mean entropy is `target` nats (bisection on the log scale)."""
    import math

    low, high = 0.0, 8.0
    for _ in range(30):
        middle = (low + high) / 2
        reference = log_softmax64(states[:256], weight * math.exp(middle))
        entropy = float(-(reference.exp() * reference).sum(-1).mean())
        low, high = (middle, high) if entropy > target else (low, middle)
    return math.exp((low + high) / 2)


def errors(states, tokens, weight, dtype, k: int) -> dict:
    """The errors of `states` sent as `dtype` against the float64 reference of the float32 states."""
    import torch

    reference = log_softmax64(states, weight)
    sent = log_softmax64(states.to(dtype).float(), weight)
    token = (sent.gather(1, tokens[:, None]) - reference.gather(1, tokens[:, None])).abs()
    top = reference.topk(k, dim=-1).indices

    def buckets(log_probs):
        values = log_probs.gather(1, top)
        tail = torch.log1p(-values.exp().sum(-1).clamp(max=1 - 1e-16))
        return torch.cat([values, tail[:, None]], dim=1)

    forward = (reference.exp() * (reference - sent)).sum(-1)
    reverse = (sent.exp() * (sent - reference)).sum(-1)
    bucket_error = (buckets(sent) - buckets(reference)).abs().max()
    return {"token_lp_mean_err": float(token.mean()), "token_lp_max_err": float(token.max()),
            "topk_tail_max_err": float(bucket_error),
            "fwd_kl_mean": float(forward.mean()), "fwd_kl_max": float(forward.max()),
            "rev_kl_mean": float(reverse.mean()), "rev_kl_max": float(reverse.max())}


def measure(plan: dict) -> list[dict]:
    import torch

    with tempfile.TemporaryDirectory() as root:
        states, tokens, weight = hidden_states(plan, root)
    width = states.shape[1]
    scale = sharpened(states, weight, TARGET_ENTROPY)
    rows = []
    heads = [("as saved", weight), (f"x {scale:.2f} (mean entropy {TARGET_ENTROPY:g} nats)", weight * scale)]
    for head, scaled in heads:
        reference = log_softmax64(states[:256], scaled)
        entropy = float(-(reference.exp() * reference).sum(-1).mean())
        for name in DTYPE_NAMES:
            dtype = getattr(torch, name)
            size = torch.tensor([], dtype=dtype).element_size()
            rows.append({"head": head, "entropy": entropy, "embed_dtype": EMBED_NAMES[name],
                         "bytes_per_token": width * size, "bytes_at_H5120": BIG_H * size,
                         **errors(states, tokens, scaled, dtype, plan["k"]),
                         "max_abs_state": float(states.abs().max()), "tokens": states.shape[0]})
    return rows


def described(plan: dict) -> str:
    return (f"hidden states sent as each embed_dtype: error against float64 of a float32 model's own states "
            f"(random Qwen3, hidden {plan['config'].get('hidden_size', 32)}, vocab {plan['config']['vocab_size']}, "
            f"{plan['rows'] * plan['length']} tokens, top-{plan['k']} + tail)")


BARS = Bars(group="embed_dtype", series="head", values=("bytes_per_token", "token_lp_max_err", "fwd_kl_mean"),
            titles=("bytes per token", "token log-prob: largest |error|", "forward KL per row (mean)"))


def run(quick: bool = False, out_dir: str | None = None) -> list[dict]:
    """Print the table; write hidden_dtypes.csv / .md / .png into `out_dir` when given."""
    plan = QUICK if quick else FULL
    return run_benchmark("hidden_dtypes", lambda: measure(plan), "head", COLUMNS,
                         described(plan), BARS, quick, out_dir)
