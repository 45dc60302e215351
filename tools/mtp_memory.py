"""`python tools/mtp_memory.py ROUTE [V]` on megatron-core >= 0.18 (Linux, glibc): one training step
(forward + backward) of a tiny GPTModel with two MTP depths (hidden 32, T = 64 x 64 = 4096 rows,
V = 8000) and its peak heap above the step's start, in units of T·V·4 (one fp32 copy of the
logits). ROUTE: `logits` (megatron's own), `fused` (the main head through
`log_prob_output_processor`, the MTP heads on megatron's logits), `fused+mtp` (patch
`mtp_output_processor` too). The heap is glibc's in-use bytes (`mallinfo2`), read after every
torch op."""
from __future__ import annotations

import ctypes
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import megatron_rl_patches
from megatron_rl_patches import log_prob_output_processor
from megatron_rl_patches.testing.megatron_cpu import make_batch, megatron_on_cpu, tiny_gpt_config

ROUTES = ("logits", "fused", "fused+mtp")
B, S = 64, 64


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _MallInfo2


def heap_bytes() -> int:
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd  # in use: small blocks + mmapped ones


class PeakHeap(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, heap_bytes())
        return out


def main(route: str, vocab: int) -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    if route not in ROUTES:
        raise SystemExit(f"ROUTE must be one of {ROUTES}, got {route!r}")
    with megatron_on_cpu():
        config = tiny_gpt_config(mtp_num_layers=2, mtp_loss_scaling_factor=0.3)
        spec = get_gpt_layer_local_spec()
        torch.manual_seed(0)
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=S,
                         mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False))
        batch = make_batch(B, S, vocab)
        args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
        if route == "fused+mtp":
            megatron_rl_patches.apply(only="mtp_output_processor")

        def step() -> None:
            if route == "logits":
                loss = model(*args, labels=batch["labels"]).mean()
            else:
                out = model(*args, labels=batch["labels"], output_processor=log_prob_output_processor())
                loss = -out["log_probs"].mean()
            loss.backward()

        step()  # the gradients exist from here on
        start = heap_bytes()
        with PeakHeap() as peak:
            step()
        unit = B * S * vocab * 4
        print(f"{route}: {(peak.peak - start) / unit:.2f} T·V·4 ({(peak.peak - start) / 2**20:.1f} MiB, "
              f"T·V·4 = {unit / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8000)
