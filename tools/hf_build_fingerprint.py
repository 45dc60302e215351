"""A fingerprint of the Hugging Face converter's output, to prove a refactor changes no byte: for
every family the test kit writes, a tiny checkpoint (write_tiny_checkpoint, seed 0) built on CPU in
float32, with the hash of its state dict (every tensor's bytes) and of its logits on a fixed batch;
every parameter's shard (convert.shard_pieces) on every rank at TP 1 / 2 / 4, hashed; and
`hf_memory_plan` on every published config fixture
(tests/apps/cli/hf_configs/) at TP 1 / 2 / 4, EP 1 / 2 / 4 where the model has experts, PP 1 / 2.
A layout a step refuses prints its error instead (the refusal is part of the behaviour).

    PYTHONPATH=<checkout> python tools/hf_build_fingerprint.py > fingerprint.txt

Run it on two checkouts and diff the outputs: a refactor of the converter must leave it empty."""
from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from megatron_rl_patches.inference.loading.hf import hf_memory_plan
from megatron_rl_patches.inference.loading.hf.convert import shard_pieces, source
from megatron_rl_patches.inference.loading.hf.families import architecture
from megatron_rl_patches.testing.hf_checkpoints import (
    HF_KINDS,
    tiny_hf_config,
    transformers_layout,
    write_tiny_checkpoint,
)

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "apps" / "cli" / "hf_configs"
VOCAB_PAD = 1024  # the padded vocab of a tiny checkpoint (1001 ids) at any TP <= 8
# beyond each family as the kit writes it: rotate-half MLA rows, one query group cut by TP, tied, biases
VARIANTS = [("deepseek_v3", {"rope_interleave": False}), ("deepseek_v3", {"q_lora_rank": None}),
            ("llama", {"num_key_value_heads": 1}), ("qwen3", {"tie_word_embeddings": True}),
            ("llama", {"attention_bias": True})]


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(str((tuple(t.shape), t.dtype)).encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def filled(shape: tuple[int, ...], pieces: list[Any]) -> torch.Tensor:
    target = torch.full(shape, float("nan"))
    for where, value in pieces:
        if value is None:
            where(target).zero_()
        else:
            where(target).copy_(value)
    return target


def shards(arch: Any, tensors: dict[str, torch.Tensor], keys: list[str], numbers: dict[int, int]) -> str:
    """Every parameter's shard on every rank at TP 1 / 2 / 4, hashed per TP."""
    lines = []
    for size in (1, 2, 4):
        made = []
        for key in keys:  # the TP 1 build holds every expert (expert offset 0)
            src = source(arch, key, numbers, 0)
            for rank in range(size):
                try:
                    shape, pieces = shard_pieces(arch, src, [tensors[n] for n in src.hf_names], rank, size, VOCAB_PAD)
                    made.append(filled(shape, pieces))
                except Exception as exc:  # noqa: BLE001 - a refusal is behaviour too
                    made.append(torch.tensor([float(len(str(exc)))]))
                    lines.append(f"  tp{size} {key} rank {rank}: {type(exc).__name__}: {exc}")
        lines.append(f"  shards tp{size}: {digest(made)}")
    return "\n".join(lines)


def build(kind: str, root: Path, **overrides: Any) -> str:
    from megatron_rl_patches import build_inference_model_from_hf
    from megatron_rl_patches.testing.megatron_cpu import make_batch, megatron_on_cpu

    config = tiny_hf_config(kind, **overrides)
    tensors = write_tiny_checkpoint(root, transformers_layout(config), seed=0)
    arch = architecture(config)
    out = [f"{kind} {overrides or ''}: checkpoint {digest(list(tensors.values()))}"]
    with megatron_on_cpu():
        try:
            chunk = build_inference_model_from_hf(root, dtype=torch.float32)[0]
        except Exception as exc:  # noqa: BLE001 - a family this megatron-core lacks is refused by name
            return "\n".join([*out, f"  build refused: {type(exc).__name__}: {str(exc).replace(str(root), '<dir>')}"])
        state = {k: v for k, v in chunk.state_dict().items() if not k.endswith("_extra_state")}
        out.append(f"  state dict ({len(state)} tensors): {digest([state[k] for k in sorted(state)])}")
        batch = make_batch(batch_size=2, seq_length=16, vocab_size=1001, seed=0)
        with torch.no_grad():
            logits = chunk(batch["tokens"], batch["position_ids"], batch["attention_mask"])
        out.append(f"  logits {tuple(logits.shape)}: {digest([logits])}")
        numbers = {i: int(layer.layer_number) - 1 for i, layer in enumerate(chunk.decoder.layers)}
        out.append(shards(arch, tensors, sorted(state), numbers))
    return "\n".join(out)


def plans() -> str:
    out = []
    for fixture in sorted(FIXTURES.glob("*.json")):
        config = json.loads(fixture.read_text())
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(config))
            moe = architecture(config, sizing=True).is_moe
            for tp in (1, 2, 4):
                for ep in ((1, 2, 4) if moe else (1,)):
                    for pp in (1, 2):
                        try:
                            plan = hf_memory_plan(tmp, tp=tp, ep=ep, pp=pp).as_dict()
                            plan.pop("source")
                            text = json.dumps(plan, sort_keys=True)
                        except Exception as exc:  # noqa: BLE001
                            text = f"{type(exc).__name__}: {str(exc).replace(tmp, '<dir>')}"
                        out.append(f"{fixture.stem} tp{tp} ep{ep} pp{pp}: {text}")
    return "\n".join(out)


def main() -> None:
    cases = [(kind, {}) for kind in HF_KINDS] + VARIANTS
    for kind, overrides in cases:
        if sys.argv[1:] and kind not in sys.argv[1:]:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            print(build(kind, Path(tmp), **overrides), flush=True)
    print(plans())


if __name__ == "__main__":
    main()
